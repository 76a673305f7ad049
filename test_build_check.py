"""
The tests of build_check.py: every Triton launch compiled for sm_80 and sm_90 without a GPU (when triton's
NVIDIA backend is installed), the launches it records in order with the programs each runs, and its verdict
on the compiler's numbers, scripted. What backend="auto" trusts from it is in test_kernel.py.
Run: python -m pytest -q test_build_check.py
"""
import json
import math
import os

from test_all import needs_triton, run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

import kernel


def _has_nvidia_backend():
    try:
        import triton
        from triton.backends import backends
        return "nvidia" in backends and os.path.exists(triton.knobs.nvidia.cuobjdump.path)
    except Exception:
        return False


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton with its NVIDIA backend (ptxas, cuobjdump) is not installed")
def test_triton_build_check_fits_a100_and_h100(tmp_path):
    """Every launch the Triton path makes, compiled ahead of time for sm_80 and sm_90 (no GPU needed):
    within the shared memory per block, no register spills. A launch over the limit fails on the GPU
    with an out-of-resources error; spills make it slow. About a minute on 2 CPU cores (fewer when cached)."""
    out = run_script("build_check.py", f"--out={tmp_path / 'build_check.json'}")  # compiles without the interpreter
    assert "launches fit in shared memory and do not spill" in out
    rows = json.load(open(tmp_path / "build_check.json"))
    assert {(r["F"], r["Dv"]) for r in rows} == {(f, d) for f in kernel.BUILD_F for d in kernel.BUILD_DV}
    assert {r["kernel"] for r in rows} == {"states", "fused", "output", "dqk", "dv", "dsquares"}
    assert {r["arch"] for r in rows} == {80, 90}
    assert {(r["D"], r["SQ"]) for r in rows if r["SQ"]} == set(kernel.BUILD_SQUARES)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad[:5]
    assert all(r["shared"] > 0 and 0 < r["regs"] <= 255 for r in rows)  # the numbers were really read


@needs_triton
@pytest.mark.parametrize("dtype,D,SQ", [(torch.bfloat16, 0, 0), (torch.float32, 0, 0), (torch.float32, 8, 2)])
def test_build_check_records_every_launch_and_its_programs(dtype, D, SQ):
    """build_check's recorded launches (one head, 4K tokens, 8 segments) in order: a forward (y in float32, for
    the backward: fused for bf16), a backward (pass 1 forwards and backwards, each segment sums then walk, then
    the gradient kernels), a forward without a backward (y in the inputs' dtype), and where the forward is fused,
    both forwards unfused too. build_check.programs, the table's last column, against each launch's grid."""
    import build_check
    F_, Dv, T = (1 + D + D * (D + 1) // 2 if SQ else 64), 64, 4096
    log = build_check.recorded_launches(F_, Dv, T, dtype, D, SQ)
    seq = []
    for fn, grid, args, meta in log:
        name = fn.fn.__name__.strip("_").removesuffix("_kernel")
        assert build_check.programs(name, F_, Dv, 1, T) == math.prod(grid), (name, grid)
        y_bf16 = name in ("output", "fused") and args[5].dtype == torch.bfloat16  # (q, k, v, S, z, y, ...)
        seq.append(("walk" if meta["WALK"] else "sums") if name == "states" else name + "/bf16" * y_bf16)
    backward = "sums walk sums walk dqk dv" + " dsquares" * bool(SQ)
    forwards = ("sums fused", "sums fused/bf16 sums walk output sums walk output/bf16") if dtype == torch.bfloat16 \
        else ("sums walk output", "sums walk output")
    assert " ".join(seq) == f"{forwards[0]} {backward} {forwards[1]}"
    assert kernel.FUSED_MAX_F == 128 and not any(isinstance(getattr(kernel, n), build_check.Recorder) for n in build_check.KERNELS)


@needs_triton
def test_build_check_fails_a_launch_over_shared_memory_or_with_spills(monkeypatch):
    """The check's verdict on the compiler's numbers, scripted here: a launch fits at exactly its arch's shared
    memory per block, not one byte over, and not with a stack frame (spilled registers)."""
    import build_check
    monkeypatch.setattr(kernel, "BUILD_F", (16,))
    monkeypatch.setattr(kernel, "BUILD_DV", (8,))
    monkeypatch.setattr(kernel, "BUILD_SQUARES", ())
    over = {"_output_kernel": (1, 0), "_dqk_kernel": (0, 8)}  # (bytes over the limit, stack bytes)

    def compiled(fn, args, meta, arch):
        extra, stack = over.get(fn.fn.__name__, (0, 0))
        return build_check.SHARED_PER_BLOCK[arch] + extra, 40, stack
    monkeypatch.setattr(build_check, "compile_launch", compiled)
    rows = build_check.build_check(verbose=False)
    assert {r["kernel"] for r in rows} >= {"states", "output", "dqk", "dv"} and {r["arch"] for r in rows} == {80, 90}
    assert all(r["ok"] == (r["kernel"] not in ("output", "dqk")) for r in rows)
