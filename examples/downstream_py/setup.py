"""The vendored copy holds Linux x86-64 shared libraries and a CPython extension (the DLPack
door), so mylib's wheel must be a platform wheel (cp311-cp311-linux_x86_64 and so on), not
py3-none-any: declaring extension modules tells setuptools so."""

from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution)
