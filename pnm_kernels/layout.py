"""Memory layouts the flat kernels, which walk raw memory, can take (mirrors csrc's
dense_like), and the lazy views (conjugate or negative bits) whose memory holds other values
than the tensor shows, which no step takes (mirrors csrc's is_lazy_view)."""
import torch


def is_dense(t: torch.Tensor) -> bool:
    """Its elements fill one block of memory without gaps or overlap, in some dim order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` is dense and laid out like `b` (equal strides where a dimension has 2 or more)."""
    if not is_dense(a):
        return False
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def dense_like(t: torch.Tensor, p: torch.Tensor) -> bool:
    """What the flat kernels need of a tensor beside its parameter: dense and laid out like
    it."""
    return (t.is_contiguous() and p.is_contiguous()) or same_dense_layout(t, p)


def fits(t: torch.Tensor, p: torch.Tensor) -> bool:
    """`t` may stand beside `p` in a flat kernel's lists: same dtype, device, shape, layout."""
    return (t.dtype == p.dtype and t.device == p.device and t.shape == p.shape
            and dense_like(t, p))


def lazy_view(t: torch.Tensor):
    """'negative' or 'conjugate' where `t` reads as its memory negated or conjugated (from
    .conj(), `z.conj().imag`, torch._neg_view): the kernels read and write the memory itself,
    so no step takes such a tensor (csrc's is_lazy_view). None otherwise."""
    if t.is_conj():
        return "conjugate"
    return "negative" if t.is_neg() else None


LAZY_VIEW_ADVICE = ("the kernels work on its memory, not on the view's values, so resolve "
                    "it first (`t.data = t.data.resolve_conj().resolve_neg()`)")

