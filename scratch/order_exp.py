"""Experiment: does opening lms_session after AdamW's state exists change the paging at 3x?"""
import sys, time, statistics, torch
import torch_uvm_saver as tus
sys.path.insert(0, "scripts")
from profile_lms_session import build, step

variant = sys.argv[1]  # "fresh": session before the first step; "after": 2 plain steps first
limit = int(8.94 * 2**30)
model, optimizer = build(checkpointing=True)
ids = torch.randint(0, 50257, (8, 1024), device="cuda")
if variant == "after":
    for _ in range(2):
        step(model, optimizer, ids)
    torch.cuda.synchronize(); torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
session = tus.lms_session(limit, [model], [optimizer])
keys = ("pageout_bytes", "clean_pageout_bytes", "pagein_bytes", "prefetch_bytes", "pageout_count", "pagein_count", "oom_events")
times = []
prev = session.stats()
for i in range(8):
    torch.cuda.synchronize(); t = time.perf_counter()
    with session:
        loss = step(model, optimizer, ids)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    now = session.stats()
    print(variant, i, f"{times[-1]*1e3:.0f} ms loss {loss:.3f}", {k: round((now[k] - prev[k]) / 1e9, 2) if "bytes" in k else now[k] - prev[k] for k in keys}, flush=True)
    prev = now
print(f"RESULT {variant}: median of steps 4-7 {statistics.median(times[4:])*1e3:.0f} ms, peak reserved {torch.cuda.max_memory_reserved()/2**30:.2f} GiB")
