"""
The tests of kernel.py: the chunked fallback and the Triton kernels against float64 at odd sizes and in
every dtype, forward and gradients; pass 1's segments and the fused forward; the polynomial maps' closed
form in the tiles; the bf16 dots; what backend="auto" trusts (the build check itself: test_build_check.py).
The Triton kernels run in Triton's CPU interpreter here (test_all.py sets TRITON_INTERPRET before triton is
imported; it is imported first below) and on the GPU on a CUDA machine.
"""
from test_all import DEV, POLYNOMIAL, make_map, needs_triton, qkv, run_script  # first: sets TRITON_INTERPRET

import pytest
import torch

import kernel
from attention import linear_attention_quadratic


def test_kernel_gradcheck():
    """Finite differences, the oracle that does not trust any backward."""
    a, b, c = qkv(B=1, H=1, T=20, D=4, Dv=3)
    args = (a.exp().requires_grad_(), b.exp().requires_grad_(), c.requires_grad_())
    assert torch.autograd.gradcheck(lambda *x: kernel.causal_linear_attention(*x, backend="torch"), args)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,F,Dv", [(1, 4, 3), (70, 33, 17), (130, 300, 130)])
def test_kernel_matches_float64(backend, dtype, T, F, Dv):
    """Forward and gradients, odd sizes: T not a multiple of the chunk, F over one 128 tile (3 K tiles),
    Dv + 1 over one tile. Inputs are rounded to `dtype`; the reference sees the same rounded values."""
    g = torch.Generator().manual_seed(0)
    qf, kf = (torch.rand(2, 2, T, F, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(2, 2, T, Dv, generator=g).to(dtype)
    dy = torch.randn(2, 2, T, Dv, generator=g)
    ins = [x.to(DEV).requires_grad_() for x in (qf, kf, v)]
    y = kernel.causal_linear_attention(*ins, backend=backend)
    grads = torch.autograd.grad(y, ins, dy.to(DEV).to(dtype))
    ref_in = [x.double().requires_grad_() for x in (qf, kf, v)]
    ref = linear_attention_quadratic(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dy.to(dtype).double())
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]  # output rounding of each dtype
    if DEV == "cuda" and backend == "triton":
        tol = max(tol, 2e-3)  # TF32 dots
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    # At T = 1 the q, k gradients are exactly 0 (y_0 = v_0: G = dnum v^T + dden cancels), so the error is
    # relative to the reference's norm plus a floor. The Triton path on bf16 inputs rounds dnum and v to
    # bf16 for its tensor-core dots (as FlashAttention's backward does), so the cancellation leaves bf16
    # noise of the O(1) terms dnum . v: its floor is the inputs' scale, 1, instead of 1e-3.
    floor = 1.0 if backend == "triton" and dtype == torch.bfloat16 else 1e-3
    for got, r in zip([y] + list(grads), [ref] + list(ref_grads)):
        err = (got.double().cpu() - r).norm() / (r.norm() + floor * r.numel() ** 0.5)
        assert err < tol, err


def _integer_inputs(Dv):
    """qf, kf in {0, 1} (kf sparse) and v in {-1, 0, 1}, bf16, F = 45, 650 tokens: every state of either
    forward is an integer below 2^8 (exact in bf16) and every sum an integer below 2^24 (exact in float32), so
    the two passes must agree bit for bit. On real-valued inputs they need not: a state summed in float32 in
    another order can round to the other bf16 neighbour before its dot (one entry of one chunk, 2e-5 of y's
    norm, on one CPU)."""
    g = torch.Generator().manual_seed(0)
    qf = torch.rand(4, 650, 45, generator=g) < 0.5
    kf = torch.rand(4, 650, 45, generator=g) < 0.2  # at most ~170 ones per feature: the states stay below 2^8
    v = torch.randint(-1, 2, (4, 650, Dv), generator=g)
    return qf.bfloat16(), kf.bfloat16(), v.bfloat16()


def _spy_on_fused(monkeypatch):
    """The grids of kernel._fused_kernel's launches from now on, in a list (the kernel still runs)."""
    launched, real = [], kernel._fused_kernel
    spy = type("Spy", (), {"__getitem__": lambda _, grid: launched.append(grid) or real[grid]})
    monkeypatch.setattr(kernel, "_fused_kernel", spy())
    return launched


@needs_triton
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("programs,min_segment,segments", [(8, 8, (11, 1)), (24, 8, (8, 2)), (32, 2, (3, 4))])
def test_kernel_segments_match_float64(programs, min_segment, segments, fused, monkeypatch):
    """Pass 1 in segments: at 8 programs per launch the 11 chunks are one segment, walked in one program
    per tile; at 24 they are two, of 8 and 3 chunks (the last one short); at 32 with segments of at least
    2 chunks, four, of 3, 3, 3 and 2 (the middle ones start from a running sum over segments). Summed,
    running-summed and walked, forwards for the forward's states and backwards for the backward's.
    fused: bfloat16 inputs, whose forward is the fused pass (4 programs per segment: segments of 8, 3 /
    8, 3 / 2 x 5, 1 chunks); else float32, pass 1 and pass 2. Forward and gradients."""
    monkeypatch.setattr(kernel, "MIN_SEGMENT", min_segment)
    monkeypatch.setattr(kernel, "STATE_PROGRAMS", programs)  # B H = 4 and 2 x 1 tiles: 8 programs per segment
    assert kernel._segments(11, 8) == segments  # (L chunks per segment, NS segments)
    launched = _spy_on_fused(monkeypatch)
    dtype = torch.bfloat16 if fused else torch.float32
    g = torch.Generator().manual_seed(0)
    qf, kf = (torch.rand(2, 2, 650, 33, generator=g).to(dtype) for _ in range(2))
    v, dy = (torch.randn(2, 2, 650, 17, generator=g).to(dtype) for _ in range(2))
    ins = [x.to(DEV).requires_grad_() for x in (qf, kf, v)]
    y = kernel.causal_linear_attention(*ins, backend="triton")
    grads = torch.autograd.grad(y, ins, dy.to(DEV))
    ref_in = [x.double().requires_grad_() for x in (qf, kf, v)]
    ref = linear_attention_quadratic(*ref_in)
    tol = 2e-2 if fused else 2e-3 if DEV == "cuda" else 1e-5  # bf16 outputs; float32 (TF32 dots on a GPU)
    for got, r in zip([y, *grads], [ref, *torch.autograd.grad(ref, ref_in, dy.double())]):
        assert (got.double().cpu() - r).norm() / r.norm() < tol
    assert launched == ([(4 * kernel._segments(11, 4)[1],)] if fused else [])  # one value tile per segment


@pytest.mark.parametrize("N,programs,segments", [(4, 96, (8, 1)), (512, 96, (13, 40)), (512, 4096, (512, 1)),
                                                  (512, 8192, (512, 1))])
def test_segments_at_the_defaults(N, programs, segments):
    """kernel._segments at STATE_PROGRAMS = 4096, MIN_SEGMENT = 8, by hand. Fig. 6's shape (B H = 12, F = 128, Dv = 64: 96
    programs a segment) asks for 4096 // 96 = 42 segments: 256 tokens are one of at least 8 chunks, 32K (512 chunks)
    40 of ceil(512 / 42) = 13. A segment of 4096 programs or more is the whole sequence (no division by zero)."""
    assert (kernel.STATE_PROGRAMS, kernel.MIN_SEGMENT) == (4096, 8)
    assert kernel._segments(N, programs) == segments


@needs_triton
@pytest.mark.parametrize("Dv", [17, 40])
@pytest.mark.parametrize("programs,min_segment,segments", [(4, 8, (11, 1)), (8, 8, (8, 2)), (32, 2, (2, 6))])
def test_kernel_fused_forward_is_the_unfused_one(programs, min_segment, segments, Dv, monkeypatch):
    """The fused forward (bf16) against pass 1 then pass 2 on the same integer inputs, bit for bit: the same
    bf16 dots summed in another order. In one segment, in segments of 8 and 3, and of 2 x 5 and 1 chunks
    (at Dv = 17; Dv = 40 takes two value tiles, twice the programs); T not a multiple of the chunk, F and
    Dv not multiples of 16 (F = 45, Taylor's at D = 8)."""
    monkeypatch.setattr(kernel, "MIN_SEGMENT", min_segment)
    monkeypatch.setattr(kernel, "STATE_PROGRAMS", programs)
    NV = -(-Dv // kernel._configs(45, Dv)["fused"]["BV"])
    assert NV == (1 if Dv == 17 else 2)
    assert Dv == 40 or kernel._segments(11, 4) == segments  # 11 chunks, 4 programs per segment (B H = 4, one tile)
    qf, kf, v = _integer_inputs(Dv)
    launched = _spy_on_fused(monkeypatch)
    fused = kernel._triton_forward(qf, kf, v, kernel.EPS)
    monkeypatch.setattr(kernel, "FUSED_MAX_F", 0)
    unfused = kernel._triton_forward(qf, kf, v, kernel.EPS)
    assert launched == [(4 * NV * kernel._segments(11, 4 * NV)[1],)]  # the first forward only
    for a, b in zip(fused, unfused):  # y, den
        assert torch.equal(a, b)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("closed_form", [False, True])
def test_kernel_forward_without_grad_is_the_training_forward(dtype, closed_form):
    """With no backward to come (no_grad, or no input that requires grad) the forward writes y in v's
    dtype at once instead of float32 y and a cast: the same values, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 150, 8, generator=g) for _ in range(2))
    fmap = make_map("taylor")
    qf, kf = (x.to(dtype) for x in fmap(q, k))
    v = torch.randn(2, 2, 150, 17, generator=g).to(dtype)
    squares = fmap.squares(q, k) if closed_form else None
    with torch.no_grad():
        fast = kernel.causal_linear_attention(qf, kf, v, backend="triton", squares=squares)
    trained = kernel.causal_linear_attention(qf.requires_grad_(), kf, v, backend="triton", squares=squares)
    assert fast.dtype == trained.dtype == dtype and trained.requires_grad and not fast.requires_grad
    assert torch.equal(fast, trained.detach())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_states_are_stored_as_the_dots_use_them(dtype, monkeypatch):
    """Pass 1 (four segments here) keeps its sums in float32 and stores the states in bfloat16 for bfloat16
    inputs, rounded to nearest: within half a bfloat16 ulp of the float64 states (truncating would be
    up to a whole one); float32 inputs keep float32 states."""
    monkeypatch.setattr(kernel, "MIN_SEGMENT", 2)
    monkeypatch.setattr(kernel, "STATE_PROGRAMS", 32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.rand(4, 650, 33, generator=g).to(dtype), torch.randn(4, 650, 17, generator=g).to(dtype)
    S, z = kernel._states(k.to(DEV), v.to(DEV), torch.ones(4, 650, device=DEV), reverse=False)
    padded = [torch.cat([x.double(), x.new_zeros(4, 11 * 64 - 650, x.shape[-1]).double()], 1) for x in (k, v)]  # 11 chunks
    sums = torch.einsum("bntf,bntd->bnfd", *(x.view(4, 11, 64, -1) for x in padded))  # each chunk's k^T v
    ref = torch.cat([torch.zeros_like(sums[:, :1]), sums.cumsum(1)[:, :-1]], 1)  # the state before each chunk
    assert S.dtype == dtype and z.dtype == torch.float32
    bits = 8 if dtype == torch.bfloat16 else 24  # significand bits
    half_ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - bits - 1)  # x = m 2^e, m in [0.5, 1)
    assert ((S.double().cpu() - ref).abs() <= half_ulp + 1e-6 * ref.abs().max()).all()


@needs_triton
@pytest.mark.parametrize("BV", [32, 64])
def test_kernel_fused_chunk_is_a_setting(BV, monkeypatch):
    """The fused pass's chunk C is a launch setting (the sweep tries 32, where one value tile of 64 fits the
    registers): at C = 32, 21 chunks in segments of 4 (6 segments, the last of one chunk), one or two value
    tiles at Dv = 40, against float64 (to bf16 rounding) and against pass 1 then pass 2 in chunks of 32 and
    the same segments (bit for bit on integer inputs: the states meet the dots rounded to bf16 at the same
    tokens)."""
    defaults = kernel._configs
    monkeypatch.setattr(kernel, "_configs", lambda F_, Dv, squares=False: {
        **defaults(F_, Dv, squares), "fused": dict(defaults(F_, Dv, squares)["fused"], C=32, BV=BV)})
    monkeypatch.setattr(kernel, "MIN_SEGMENT", 4)
    monkeypatch.setattr(kernel, "STATE_PROGRAMS", 96)  # B H = 4: 4 or 8 programs a segment here, 16 in pass 1
    NV = 1 if BV == 64 else 2
    assert kernel._segments(21, 4 * NV) == kernel._segments(21, 16) == (4, 6)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, 650, 8, generator=g) for _ in range(2))
    qf, kf = (x[0].bfloat16().contiguous() for x in make_map("taylor", D=8, H=1)(q[None], k[None]))  # F = 45
    v = torch.randn(4, 650, 40, generator=g).bfloat16()
    launched = _spy_on_fused(monkeypatch)
    fused = kernel._triton_forward(qf, kf, v, kernel.EPS)
    assert launched == [(4 * NV * kernel._segments(21, 4 * NV)[1],)]
    ref = linear_attention_quadratic(*(x.double()[None] for x in (qf, kf, v)))[0]
    assert (fused[0].double() - ref).norm() / ref.norm() < 2e-2
    qf, kf, v = _integer_inputs(40)
    fused = kernel._triton_forward(qf, kf, v, kernel.EPS)
    monkeypatch.setattr(kernel, "CHUNK", 32)
    monkeypatch.setattr(kernel, "FUSED_MAX_F", 0)
    unfused = kernel._triton_forward(qf, kf, v, kernel.EPS)
    for a, b in zip(fused, unfused):  # y, den
        assert torch.equal(a, b)


def test_auto_backend_covers_the_build_checked_sizes():
    """auto sends to Triton (on CUDA) only sizes that compile to build-checked code."""
    if not kernel.HAS_TRITON:
        pytest.skip("triton is not installed")
    assert all(kernel.triton_covered(f, d) for f in kernel.BUILD_F for d in kernel.BUILD_DV)
    assert kernel.triton_covered(4161, 64)  # same tiles and divisibility as 2145
    # an int of 1 is compiled in; Dv 130: untested tiles
    assert not kernel.triton_covered(1, 64) and not kernel.triton_covered(64, 130)
    # Dv 40 takes Dv 64's tiles but is not a multiple of 16 (Triton compiles that in); 48 is, and is covered
    assert kernel._configs(64, 40) == kernel._configs(64, 64)
    assert not kernel.triton_covered(64, 40) and kernel.triton_covered(64, 48)
    assert all(kernel.triton_covered(1 + D + D * (D + 1) // 2, dv, D, SQ)
               for D, SQ in kernel.BUILD_SQUARES for dv in kernel.BUILD_DV)
    assert not kernel.triton_covered(2145, 64, 64, 3)  # 3 terms (OAL with 2 groups) are another compilation
    assert not kernel.triton_covered(8385, 64, 128, 2)  # D = 128: a tile of 128, not build-checked


def test_which_forward_is_fused_and_which_triton_is_new_enough():
    """The fused forward takes bfloat16 features up to FUSED_MAX_F = 128, Hedgehog's F at D = 64, and no closed
    form; the kernels take triton 3.6 and later, 3.10 after 3.9 (numbers, not strings)."""
    assert kernel.FUSED_MAX_F == 128 and kernel._is_fused(128, torch.bfloat16, None) and kernel._is_fused(1, torch.bfloat16, None)
    assert not any(kernel._is_fused(F_, dt, None) for F_, dt in ((129, torch.bfloat16), (128, torch.float32), (128, torch.float16)))
    assert not kernel._is_fused(45, torch.bfloat16, (None,) * 5)  # Taylor at D = 8 with its closed form
    assert all(kernel.new_enough(v) for v in ("3.6.0", "3.9.0", "3.10.1", "4.0"))
    assert not any(kernel.new_enough(v) for v in ("3.5.1", "2.1.0", "3.1"))


def test_an_older_triton_counts_as_absent(tmp_path):
    """A triton older than kernel.TRITON_MIN (torch 2.1 pins its own 2.1, which aborts compiling the closed
    form) leaves the PyTorch fallback: auto runs it, backend="triton" refuses in one line that names the version."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('__version__ = "2.1.0"\n')
    (tmp_path / "triton" / "language.py").write_text("")
    code = ("import torch, kernel\n"
            "x = torch.rand(1, 2, 9, 4)\n"
            "print(kernel.HAS_TRITON, torch.equal(kernel.causal_linear_attention(x, x, x),\n"
            "                                     kernel.causal_linear_attention(x, x, x, backend='torch')))\n"
            "try:\n    kernel.causal_linear_attention(x, x, x, backend='triton')\n"
            "except RuntimeError as e:\n    print(e)\n")
    (tmp_path / "check.py").write_text(code)
    out = run_script(str(tmp_path / "check.py"), cwd=tmp_path).splitlines()
    assert out == ["False True", "backend='triton' cannot run here: triton 2.1.0 is older than 3.6, the oldest the kernels "
                   "are built with. Use backend='torch'."], out


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32),
                                           pytest.param("triton", torch.float32, marks=needs_triton),
                                           pytest.param("triton", torch.bfloat16, marks=needs_triton)])
@pytest.mark.parametrize("name", POLYNOMIAL)
@pytest.mark.parametrize("T,D", [(10, 12), (70, 12), (130, 16)])
def test_kernel_squares_match_float64(backend, dtype, name, T, D):
    """The scores within a chunk from the closed form (kernel squares=): output and gradients of q, k, v and
    the map's parameters against the float64 O(T^2) form on the features. T within one chunk (no state), or
    not a multiple of the chunk, D not a multiple of 16 (12) and one tile (16). bfloat16: the features
    rounded to it before the kernel, which then takes bf16 dots, the closed form's too."""
    fmap = make_map(name, D=D, H=3)
    q, k, v = (x.requires_grad_() for x in qkv(B=2, H=3, T=T, D=D, Dv=9))
    params = [q, k, v] + list(fmap.parameters())
    dy = torch.randn(2, 3, T, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = linear_attention_quadratic(*fmap(q, k), v)
    refs = [ref, *torch.autograd.grad(ref, params, dy)]
    fmap.float()
    q32, k32, v32 = (x.detach().float().to(DEV).requires_grad_() for x in (q, k, v))
    fmap.to(DEV)
    qf, kf = (x.to(dtype) for x in fmap(q32, k32))
    y = kernel.causal_linear_attention(qf, kf, v32, backend=backend, squares=fmap.squares(q32, k32))
    got = [y, *torch.autograd.grad(y, [q32, k32, v32] + list(fmap.parameters()), dy.float().to(DEV))]
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3 if DEV == "cuda" else 1e-5  # bf16; float32 (TF32 dots on a GPU)
    for x, r in zip(got, refs):
        assert ((x.double().cpu() - r).norm() / r.norm()).item() < tol


@needs_triton
def test_kernel_squares_gradients_of_every_input():
    """The Triton closed-form backward, each of the eight inputs' gradient, against the fallback's in float64
    (gradchecked below) with the same chunk: the chunk decides which pairs' gradient goes through the closed
    form and which through the features. base and c too, which no map's parameters read: base is set to
    O(1) values per head here (every map's is 0, or OAL's eps), so that the forward's use of it counts."""
    fmap = make_map("oal", D=12, H=3)
    q, k, v = qkv(B=2, H=3, T=70, D=12, Dv=9)
    inputs = [x.detach() for x in (*fmap(q, k), v, *fmap.squares(q, k))]  # qf, kf, v, then q, k, lam, c, base
    inputs[-1] = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    dy = torch.randn(2, 3, 70, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in inputs]
    ref = kernel._ChunkedLinearAttention.apply(*ref_in[:3], kernel.EPS, kernel.CHUNK, *ref_in[3:])
    refs = torch.autograd.grad(ref, ref_in, dy)
    ins = [x.float().to(DEV).requires_grad_() for x in inputs]
    y = kernel.causal_linear_attention(*ins[:3], backend="triton", squares=ins[3:])
    got = torch.autograd.grad(y, ins, dy.float().to(DEV))
    tol = 2e-3 if DEV == "cuda" else 1e-4  # TF32 dots on a GPU
    for g, r in zip(got, refs):
        assert ((g.double().cpu() - r).norm() / r.norm()).item() < tol


def test_kernel_squares_gradcheck():
    """Finite differences through the fallback's closed-form backward, every input of squares included."""
    fmap = make_map("oal", D=4, H=1)
    q, k, v = (x.requires_grad_() for x in qkv(B=1, H=1, T=20, D=4, Dv=3))
    qs, ks, lam, c, base = (x.detach().clone().requires_grad_() for x in fmap.squares(q, k))
    qf, kf = (x.detach().requires_grad_() for x in fmap(q, k))
    f = lambda *x: kernel.causal_linear_attention(x[0], x[1], x[2], backend="torch", squares=x[3:])
    assert torch.autograd.gradcheck(f, (qf, kf, v, qs, ks, lam, c, base))


@needs_triton
def test_bf16_dot_rounds_its_operands():
    """kernel._dot(BF16=True): both operands rounded to bfloat16 (to nearest, ties to even, as torch and the
    GPU round), products summed in float32. (In the CPU interpreter this is emulated; on a GPU it is the
    tensor-core dot.) It must differ from the float32 dot."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_kernel(x_ptr, out_ptr):
        r = tl.arange(0, 16)
        tl.store(out_ptr + r, kernel._round_bf16(tl.load(x_ptr + r)))

    ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8)]  # halfway: to even, both signs
    x = torch.tensor(ties + [0.0, -0.0, 1e-30, 3e38] + torch.randn(8, generator=torch.Generator().manual_seed(1)).tolist())
    out = torch.empty(16, device=DEV)
    round_kernel[(1,)](x.to(DEV), out)
    assert torch.equal(out.cpu(), x.bfloat16().float())

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, out_ptr, BF16: tl.constexpr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], kernel._dot(a, b, BF16))

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(DEV) for _ in range(2))
    out = {flag: torch.empty(16, 16, device=DEV) for flag in (True, False)}
    for flag in out:
        dot_kernel[(1,)](a, b, out[flag], BF16=flag)
    rounded = a.bfloat16().double() @ b.bfloat16().double()
    assert torch.allclose(out[True].double(), rounded, rtol=1e-5, atol=1e-5)
    assert (out[True].double() - a.double() @ b.double()).abs().max() > 1e-3  # the rounding is really there
    if DEV == "cpu":  # the interpreter's float32 dot; a GPU's is TF32
        assert torch.allclose(out[False].double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_input():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="shape"):
        kernel.causal_linear_attention(q, k[:, :, :5], v)
    with pytest.raises(ValueError, match="backend"):
        kernel.causal_linear_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="floating-point qf, kf, v; got torch.float64, torch.float64, torch.int64"):
        kernel.causal_linear_attention(q, k, v.long())
    for eps in (-1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            kernel.causal_linear_attention(q, k, v, eps=eps)
    qf, kf = q.exp(), k.exp()  # eps = 0 is allowed: the exact normalisation, for maps with no row of zeros
    exact = kernel.causal_linear_attention(qf, kf, v, eps=0.0, backend="torch")
    assert torch.allclose(exact, linear_attention_quadratic(qf, kf, v, eps=0.0), rtol=1e-10, atol=1e-12)
    qs, ks, lam, c, base = make_map("taylor").squares(q, k)
    for bad in ((qs, ks, lam[:1], c, base), (qs, ks, lam, c[:, :1], base), (qs, ks, lam, c, base[:1]),
                (qs, ks[:, :1], lam, c, base)):
        with pytest.raises(ValueError, match="squares: expected q, k"):
            kernel.causal_linear_attention(q, k, v, squares=bad)
