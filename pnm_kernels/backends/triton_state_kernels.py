"""Triton kernels for state in a dtype of its own (docs/design.md §7, §8): bfloat16 state
written with stochastic rounding, float32 state of 16-bit parameters, bfloat16 parameters
rounded stochastically, and int8 state. The same random bits as every other path
(pnm_kernels/rounding.py: a hash of the seed, the step and the element's index in the whole
parameter), the same codes (pnm_kernels/quantization.py). The element maths are
triton_kernels.py's. Launched without FMA contraction (enable_fp_fusion=False) and with
correctly rounded square roots and divisions where a rounding decision depends on them, so a
code or a rounded bit pattern depends only on the float32 value it stores.

Tables as triton_kernels.py's, with each tensor's seed address (0 where nothing rounds
stochastically) and offset; int8 tables count quantisation blocks and add each buffer's
scales and each tensor's row length. Step counters are incremented by a second launch.
"""
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .triton_kernels import _element_math, _store, _tensor_constants

GOLDEN = tl.constexpr(0x9E3779B9)  # rounding.GOLDEN
INT8_BLOCK = tl.constexpr(128)  # quantization.BLOCK (a test checks the two agree)


@triton.jit
def _mix32(x):
    """rounding.mix32 on uint32 values."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0xD35A2D97
    x ^= x >> 15
    return x


@triton.jit
def _element_hash(seed, step, index):
    """rounding.element_hash: seed and step as uint32 scalars, index int64."""
    hi = (index >> 32).to(tl.uint32)
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(hi + GOLDEN)
    key = _mix32(key ^ step)
    key = _mix32(key ^ seed)
    return _mix32(lo ^ key)


@triton.jit
def _store_bf16_stochastic(ptr, x, bits, mask):
    """rounding.round_bf16_stochastic: (bits(x) + 16 random bits) >> 16; NaN as 0x7FC0."""
    rounded = (x.to(tl.uint32, bitcast=True) + bits) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    tl.store(ptr, rounded.to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _store_state(ptr, x, bits, mask, STATE_DTYPE: tl.constexpr):
    if STATE_DTYPE == tl.bfloat16:
        _store_bf16_stochastic(ptr, x, bits, mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _store_param(ptr, x, hashes, mask, DTYPE: tl.constexpr, PARAM_SR: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    if PARAM_SR:  # rounding.PARAM_SHIFT: the low 16 bits of mix32(hash)
        _store_bf16_stochastic(ptr, x, _mix32(hashes) & 0xFFFF, mask)
    else:
        _store(ptr, x, mask, DTYPE, INTERPRETED)


@triton.jit
def _chunk_setup(chunk_tensor, chunk_start, numels, step_table, seed_table, offsets, lr,
                 lr_ptr, grad_sign, grad_scale_ptr, found_inf_ptr, log_b1, log_b2,
                 weight_decay, NEEDS_HASH: tl.constexpr, ADAPTIVE: tl.constexpr,
                 HAS_LR_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
                 HAS_FOUND_INF: tl.constexpr):
    """This program's tensor t, its chunk's start, the tensor's count (0 in a step skipped
    for found_inf: nothing is written), the step's parity, the hash's seed and step (the
    counter + 1, incremented by a later launch), the gradient's factor, the tensor's
    constants (triton_kernels._tensor_constants) and its offset in the whole parameter."""
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    count = tl.load(numels + t)
    if HAS_FOUND_INF:
        count = tl.where(tl.load(found_inf_ptr) == 0.0, count, 0)
    step = tl.load(tl.load(step_table + t).to(tl.pointer_type(tl.float64))) + 1.0
    step_bits = (step.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    seed = step_bits  # unused without NEEDS_HASH
    if NEEDS_HASH:
        seed_ptr = tl.load(seed_table + t).to(tl.pointer_type(tl.int64))
        seed = (tl.load(seed_ptr) & 0xFFFFFFFF).to(tl.uint32)
    if HAS_LR_TENSOR:
        lr = tl.load(lr_ptr)
    grad_factor = grad_sign
    if HAS_GRAD_SCALE:
        grad_factor = grad_sign / tl.load(grad_scale_ptr)
    decay, neg_step_size, bc2_sqrt = _tensor_constants(step, lr, log_b1, log_b2, weight_decay,
                                                       ADAPTIVE)
    odd = (step.to(tl.int64) % 2) == 1
    return (t, start, count, odd, seed, step_bits, grad_factor, decay, neg_step_size, bc2_sqrt,
            tl.load(offsets + t))


@triton.jit
def _state_step_kernel(ptr_table, numels, step_table, seed_table, offsets, chunk_tensor,
                       chunk_start, n_tensors, lr, lr_ptr, grad_scale_ptr, found_inf_ptr,
                       b1_sq, one_minus_b1_sq, b2, one_minus_b2, log_b1, log_b2, pos_coef,
                       neg_coef, inv_noise_norm, eps, weight_decay, grad_sign,
                       DTYPE: tl.constexpr, STATE_DTYPE: tl.constexpr, PARAM_SR: tl.constexpr,
                       ADAPTIVE: tl.constexpr, AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr,
                       HAS_LR_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
                       HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    """bfloat16 or float32 state (csrc/state_block.h's semantics): one chunk of one tensor."""
    NEEDS_HASH: tl.constexpr = PARAM_SR or STATE_DTYPE == tl.bfloat16
    (t, start, numel, odd, seed, step_bits, grad_factor, decay, neg_step_size, bc2_sqrt,
     offset) = _chunk_setup(chunk_tensor, chunk_start, numels, step_table, seed_table, offsets,
                            lr, lr_ptr, grad_sign, grad_scale_ptr, found_inf_ptr, log_b1,
                            log_b2, weight_decay, NEEDS_HASH, ADAPTIVE, HAS_LR_TENSOR,
                            HAS_GRAD_SCALE, HAS_FOUND_INF)

    p_ptr = tl.load(ptr_table + t).to(tl.pointer_type(DTYPE))
    g_ptr = tl.load(ptr_table + n_tensors + t).to(tl.pointer_type(DTYPE))
    pos = tl.load(ptr_table + 2 * n_tensors + t)
    neg = tl.load(ptr_table + 3 * n_tensors + t)
    m_ptr = tl.where(odd, pos, neg).to(tl.pointer_type(STATE_DTYPE))  # written
    m_other_ptr = tl.where(odd, neg, pos).to(tl.pointer_type(STATE_DTYPE))
    v_ptr = m_ptr  # placeholders, never read unless ADAPTIVE / AMSGRAD
    v_max_ptr = m_ptr
    if ADAPTIVE:
        v_ptr = tl.load(ptr_table + 4 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))
        if AMSGRAD:
            v_max_ptr = tl.load(ptr_table + 5 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))

    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_factor
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        m_other = tl.load(m_other_ptr + offs, mask=mask).to(tl.float32)
        v = p
        v_max = p
        if ADAPTIVE:
            v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
            if AMSGRAD:
                v_max = tl.load(v_max_ptr + offs, mask=mask).to(tl.float32)
        p, m, v, v_max = _element_math(p, g, m, m_other, v, v_max, decay, b1_sq,
                                       one_minus_b1_sq, b2, one_minus_b2, pos_coef, neg_coef,
                                       inv_noise_norm, eps, weight_decay, neg_step_size,
                                       bc2_sqrt, ADAPTIVE, AMSGRAD, DECOUPLED)
        hashes = offs.to(tl.uint32)  # unused without NEEDS_HASH
        if NEEDS_HASH:
            hashes = _element_hash(seed, step_bits, offset + offs.to(tl.int64))
        _store_param(p_ptr + offs, p, hashes, mask, DTYPE, PARAM_SR, INTERPRETED)
        _store_state(m_ptr + offs, m, hashes >> 16, mask, STATE_DTYPE)
        if ADAPTIVE:
            _store_state(v_ptr + offs, v, hashes & 0xFFFF, mask, STATE_DTYPE)
            if AMSGRAD:
                _store_state(v_max_ptr + offs, v_max, hashes & 0xFFFF, mask, STATE_DTYPE)


@triton.jit
def _magnitude(code, CODE_MAX: tl.constexpr, POWER: tl.constexpr):
    """quantization._magnitude: (code / CODE_MAX)^POWER, multiplied out."""
    t = code * (1.0 / CODE_MAX)
    t = t * t
    if POWER == 4:
        t = t * t
    return t


@triton.jit
def _decode(codes, scales, SIGNED: tl.constexpr):
    c = codes.to(tl.int32)
    if SIGNED:
        m = _magnitude(tl.abs(c).to(tl.float32), 127, 2) * scales
        return tl.where(c < 0, -m, m)
    return _magnitude(c.to(tl.float32), 255, 4) * scales


@triton.jit
def _encode(ptr, scale_ptr, x, bits, mask, block_mask, SIGNED: tl.constexpr):
    """quantization.quantize over a tile of blocks (rows: blocks, columns: their elements);
    writes the codes and each block's scale."""
    u = x.to(tl.uint32, bitcast=True)
    scale_bits = tl.where(mask, u & 0x7FFFFFFF, 0)
    if not SIGNED:  # a negative value (not -0.0) counts as NaN
        scale_bits = tl.where(mask & (u > 0x80000000), 0xFFFFFFFF, scale_bits)
    largest = tl.max(scale_bits, axis=1)
    scale = tl.where(largest < 0x7F800000, largest, 0x7FC00000).to(tl.float32, bitcast=True)
    # A subnormal scale's values and scale lifted by 2^24 (exact): 1 / scale would overflow.
    lift = tl.where(largest < 0x00800000, 16777216.0, 1.0)
    inverse = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale * lift)
    tl.store(scale_ptr, scale, mask=block_mask)
    CODE_MAX: tl.constexpr = 127 if SIGNED else 255
    POWER: tl.constexpr = 2 if SIGNED else 4
    a = (tl.abs(x) * lift[:, None]) * inverse[:, None]  # NaN where the scale is 0 or NaN: code 0
    root = tl.sqrt_rn(a)
    if POWER == 4:
        root = tl.sqrt_rn(root)
    low = tl.floor(root * CODE_MAX)
    low = tl.where(low >= 0.0, low, 0.0)  # and NaN to 0
    low = tl.where(low < CODE_MAX - 1.0, low, CODE_MAX - 1.0)
    below = _magnitude(low, CODE_MAX, POWER)
    above = _magnitude(low + 1.0, CODE_MAX, POWER)
    draw = bits.to(tl.int32).to(tl.float32) * (1.0 / 65536.0)
    up = draw * (above - below) < a - below
    code = (low + up.to(tl.float32)).to(tl.int32)
    if SIGNED:
        tl.store(ptr, tl.where(x < 0.0, -code, code).to(tl.int8), mask=mask)
    else:
        tl.store(ptr, code.to(tl.uint8), mask=mask)


@triton.jit
def _int8_step_kernel(ptr_table, scale_table, numels, row_lengths, step_table, seed_table,
                      offsets, chunk_tensor, chunk_start, n_tensors, lr, lr_ptr, grad_scale_ptr,
                      found_inf_ptr, b1_sq, one_minus_b1_sq, b2, one_minus_b2, log_b1, log_b2,
                      pos_coef, neg_coef, inv_noise_norm, eps, weight_decay, grad_sign,
                      DTYPE: tl.constexpr, PARAM_SR: tl.constexpr, ADAPTIVE: tl.constexpr,
                      AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr,
                      HAS_LR_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
                      HAS_FOUND_INF: tl.constexpr, BLOCKS: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """int8 state (quantization.py): BLOCKS quantisation blocks of one tensor a program, a
    tile of (BLOCKS, INT8_BLOCK) elements; a block's new scale is its row's largest
    magnitude. numels counts each tensor's blocks."""
    (t, start, n_blocks, odd, seed, step_bits, grad_factor, decay, neg_step_size, bc2_sqrt,
     offset) = _chunk_setup(chunk_tensor, chunk_start, numels, step_table, seed_table, offsets,
                            lr, lr_ptr, grad_sign, grad_scale_ptr, found_inf_ptr, log_b1,
                            log_b2, weight_decay, True, ADAPTIVE, HAS_LR_TENSOR,
                            HAS_GRAD_SCALE, HAS_FOUND_INF)
    row_length = tl.load(row_lengths + t)
    per_row = (row_length + INT8_BLOCK - 1) // INT8_BLOCK

    blocks = start + tl.arange(0, BLOCKS)  # among the tensor's blocks
    block_mask = blocks < n_blocks
    row = blocks // per_row
    in_row = blocks - row * per_row
    column = in_row[:, None] * INT8_BLOCK + tl.arange(0, INT8_BLOCK)[None, :]
    mask = block_mask[:, None] & (column < row_length)
    offs = row[:, None] * row_length + column  # elements of the tensor

    p_ptr = tl.load(ptr_table + t).to(tl.pointer_type(DTYPE))
    g_ptr = tl.load(ptr_table + n_tensors + t).to(tl.pointer_type(DTYPE))
    pos = tl.load(ptr_table + 2 * n_tensors + t)
    neg = tl.load(ptr_table + 3 * n_tensors + t)
    pos_scales = tl.load(scale_table + t)
    neg_scales = tl.load(scale_table + n_tensors + t)
    m_ptr = tl.where(odd, pos, neg).to(tl.pointer_type(tl.int8))  # written
    m_other_ptr = tl.where(odd, neg, pos).to(tl.pointer_type(tl.int8))
    m_scale_ptr = tl.where(odd, pos_scales, neg_scales).to(tl.pointer_type(tl.float32))
    m_other_scale_ptr = tl.where(odd, neg_scales, pos_scales).to(tl.pointer_type(tl.float32))

    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_factor
    m = _decode(tl.load(m_ptr + offs, mask=mask),
                tl.load(m_scale_ptr + blocks, mask=block_mask)[:, None], True)
    m_other = _decode(tl.load(m_other_ptr + offs, mask=mask),
                      tl.load(m_other_scale_ptr + blocks, mask=block_mask)[:, None], True)
    v = p
    v_max = p
    v_ptr = m_ptr  # placeholders, never read unless ADAPTIVE / AMSGRAD
    v_max_ptr = m_ptr
    v_scale_ptr = m_scale_ptr
    v_max_scale_ptr = m_scale_ptr
    if ADAPTIVE:
        v_ptr = tl.load(ptr_table + 4 * n_tensors + t).to(tl.pointer_type(tl.uint8))
        v_scale_ptr = tl.load(scale_table + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v = _decode(tl.load(v_ptr + offs, mask=mask),
                    tl.load(v_scale_ptr + blocks, mask=block_mask)[:, None], False)
        if AMSGRAD:
            v_max_ptr = tl.load(ptr_table + 5 * n_tensors + t).to(tl.pointer_type(tl.uint8))
            v_max_scale_ptr = tl.load(scale_table + 3 * n_tensors + t).to(
                tl.pointer_type(tl.float32))
            v_max = _decode(tl.load(v_max_ptr + offs, mask=mask),
                            tl.load(v_max_scale_ptr + blocks, mask=block_mask)[:, None], False)
    p, m, v, v_max = _element_math(p, g, m, m_other, v, v_max, decay, b1_sq, one_minus_b1_sq,
                                   b2, one_minus_b2, pos_coef, neg_coef, inv_noise_norm, eps,
                                   weight_decay, neg_step_size, bc2_sqrt, ADAPTIVE, AMSGRAD,
                                   DECOUPLED)
    hashes = _element_hash(seed, step_bits, offset + offs.to(tl.int64))
    _store_param(p_ptr + offs, p, hashes, mask, DTYPE, PARAM_SR, INTERPRETED)
    _encode(m_ptr + offs, m_scale_ptr + blocks, m, hashes >> 16, mask, block_mask, True)
    if ADAPTIVE:
        _encode(v_ptr + offs, v_scale_ptr + blocks, v, hashes & 0xFFFF, mask, block_mask, False)
        if AMSGRAD:
            _encode(v_max_ptr + offs, v_max_scale_ptr + blocks, v_max, hashes & 0xFFFF, mask,
                    block_mask, False)
