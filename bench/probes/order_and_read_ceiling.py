# GPU probe of bench/GPU_NOTES.md run 33a-b; run from the repository root on a CUDA machine.
# Its figures in run 33a were taken with gpu_bench timers as they were then (one warm-up call).
# (1) Is the first-measured M slower (warm-up artefact)? (2) What does a pure read of the
# same bytes reach (size-matched ceiling)?
import sys, time
sys.path.insert(0, "bench")
import torch, torch.nn.functional as F
from gpu_bench import event_time_us, graph_time_us, copies_for
import portable_gemm as pg
torch.manual_seed(0)
for k, n in [(28672, 8192), (8192, 8192)]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for bits, g in [(4, 128), (8, None)]:
        q, s = pg.quantize_weight(w, bits=bits, group_size=g)
        nq = copies_for(q.numel() * q.element_size())
        qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
        line = []
        for m, mode in [(1, "e"), (2, "e"), (1, "e"), (1, "e"), (1, "g"), (2, "g"), (1, "g")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            f = lambda i=0: pg.mixed_linear(x, *qs[i % nq], bits=bits, group_size=g)
            t = event_time_us(f, 50)[0] if mode == "e" else graph_time_us(f, 20)
            line.append(f"M{m}{mode} {t:6.1f}")
        print(f"K={k} N={n} int{bits} g{g or 'ch'}: " + "  ".join(line), flush=True)
        del qs
    del w
torch.cuda.empty_cache()
try:
    import triton, triton.language as tl

    @triton.jit
    def _read(p, out, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(p + offs, mask=offs < n, other=0, cache_modifier=".cg")
        tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)
except Exception as e:
    print("triton unavailable", e); _read = None
sms = torch.cuda.get_device_properties(0).multi_processor_count
for nbytes in [32 << 20, 64 << 20, 112 << 20, 224 << 20]:
    nc = copies_for(nbytes)
    bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), device="cuda", dtype=torch.int32) for _ in range(nc)]
    dst = [torch.empty_like(b) for b in bufs]
    res = []
    t = graph_time_us(lambda i=0: dst[i % nc].copy_(bufs[i % nc]), 20)
    res.append(f"copy graph {t:6.1f} us ({2*nbytes/t/1e6:4.2f} TB/s r+w)")
    t = graph_time_us(lambda i=0: bufs[i % nc].sum(), 20)
    res.append(f"sum graph {t:6.1f} us ({nbytes/t/1e6:4.2f})")
    if _read is not None:
        best = None
        for per in (2, 4, 8, 16):
            for blk in (1024, 2048, 4096):
                outb = torch.empty(per * sms * blk, device="cuda", dtype=torch.int32)
                f = lambda i=0: _read[(per * sms,)](bufs[i % nc], outb, nbytes // 4, BLOCK=blk)
                tg = graph_time_us(f, 20); te = event_time_us(f, 50)[0]
                if best is None or tg < best[0]:
                    best = (tg, te, per, blk)
        res.append(f"triton read best graph {best[0]:6.1f} us ({nbytes/best[0]/1e6:4.2f} TB/s) eager {best[1]:6.1f} (grid {best[2]}xSM, BLOCK {best[3]})")
    print(f"{nbytes >> 20} MiB: " + "; ".join(res), flush=True)
    del bufs, dst
