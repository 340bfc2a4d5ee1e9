// bf16 <-> float for the kernel probes' inputs and references (round to nearest even; the
// probes never feed NaN).
#pragma once
#include <cstdint>
#include <cstring>

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
static inline float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
