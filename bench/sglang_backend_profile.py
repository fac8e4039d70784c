"""Where the plugin's decode step spends its device time, by kernel, at 8K and 1M configured:
`python -m bench.sglang_backend_profile OUT.json [--batches 1,32,64,128]` (GPU; the SGLang-backend rig's setup,
as `bash bench/gpu.sh sglang_backend` prepares it).

Per context and batch (2,048 live tokens a request): SGLang's 43-layer step captured as SGLang's decode runner
does (`sglang_backend.capture`), plugin and decode stock, warmed by 3 replays, then the torch profiler over 10
replays: per kernel name its device time a step and its launches a step, the sum (`busy_us`) and the span from
the first kernel's start to the last one's end (`span_us`). The sum does not move with the host or the machine's
drift between rows, so its 1M / 8K is the step's growth that the kernels themselves cause.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys

from . import sglang_backend as sb
from . import sglang_backend_rig as rig
from .common import ints

LIVE, REPS = 2048, 10


def _profile(replay, reps: int) -> dict:
    import torch

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    agg: dict = collections.defaultdict(lambda: [0.0, 0])
    starts, ends = [], []
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:90]][0] += e.time_range.elapsed_us() / reps
            agg[e.name[:90]][1] += 1
            starts.append(e.time_range.start)
            ends.append(e.time_range.end)
    return {"kernels": {k: [round(v[0], 2), v[1] // reps] for k, v in agg.items()},
            "busy_us": round(sum(v[0] for v in agg.values()), 1),
            "span_us": round((max(ends) - min(starts)) / reps, 1) if starts else 0.0}


def run(out: str, batches: list[int]) -> dict:
    import torch

    rig.install_import_stand_ins()
    rig.set_mode_env("plugin")
    import sglang.srt.layers.attention.deepseek_v4_backend  # noqa: F401

    rig.install_stand_ins("plugin")
    rig.load_plugins_and_check("plugin")
    max_reqs, tokens = sb.pool_shape(batches, LIVE)
    res: dict = {}
    for context in (8192, 1048576):
        r = rig.build(context, max_reqs, tokens, "plugin", "cuda", None)
        rig.fill(r)
        r.backend.init_cuda_graph_state(max(batches), max(batches))
        for b in batches:
            fb, inputs = rig.decode_batch(r, b, LIVE), rig.layer_inputs(r, b)
            sb.eager_step(r, fb, inputs)
            torch.cuda.synchronize()
            routed = r.backend._flash_mla_with_kvcache
            for name, call in (("plugin", routed), ("decode_stock", routed.dsv4_stock)):
                r.backend._flash_mla_with_kvcache = call
                res[f"{context} {b} {name}"] = _profile(sb.capture(r, fb, inputs)[2], REPS)
                print(context, b, name, res[f"{context} {b} {name}"]["busy_us"], flush=True)
            r.backend._flash_mla_with_kvcache = routed
            fb = inputs = None
        del r
        gc.collect()
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sglang_backend_profile")
    ap.add_argument("out")
    ap.add_argument("--batches", type=ints, default=[1, 32, 64, 128])
    a = ap.parse_args(argv)
    res = run(a.out, a.batches)
    for b in a.batches:
        for name in ("plugin", "decode_stock"):
            x, z = res[f"8192 {b} {name}"], res[f"1048576 {b} {name}"]
            print(f"B={b} {name}: busy {x['busy_us']} -> {z['busy_us']} us ({z['busy_us'] / x['busy_us']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
