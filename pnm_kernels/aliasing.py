"""The memory a step writes is its own (docs/design.md §5): no tensor of a parameter's state
that the step reads (a buffer, its int8 scales, the counter, the seed) may be, or share memory
with, another such tensor, a parameter or a gradient of the step. Each backend would step
aliased memory another way (the reference one tensor after another, the kernels all at once),
so a state tensor put under two keys or parameters by hand, or made a view of another's
memory, is refused before anything is touched. Checked where a step's lists are built (after
any edit of the state), not at every step."""
import torch

from .params import local

# What a tensor is to its parameter, besides one of its state's keys.
PARAMETER = "parameter"
GRADIENT = "gradient"

# Above this many bytes a tensor, two strided tensors whose spans interleave are taken as
# sharing memory rather than compared byte by byte (the comparison takes 8 bytes a byte).
_EXACT_BYTES = 1 << 26


class SharedMemoryError(RuntimeError):
    """args: the owners (parameter, key) of two tensors that share memory, and whether they
    are the very same tensor."""


class MemoryClaims:
    """The tensors a step will read and write, each with its owner (a parameter and a key);
    `add` them, then `check`: SharedMemoryError for the first two that share memory. A build
    of 10,000 parameters' lists adds some 70,000, so each is kept in flat lists of plain
    values: a tuple a claim gave the garbage collector so much to walk that its passes cost
    as much as the claims)."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # first byte
        self._ends: list[int] = []  # past the last byte
        self._dense: list[bool] = []  # covers every byte between once
        self._tensors: list = []
        self._params: list = []
        self._keys: list = []

    def add(self, tensor, param, key) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        t = tensor if type(tensor) in _PLAIN else local(tensor)
        n = t.numel()
        if n == 0 or t.layout != torch.strided or t.is_meta:  # no memory of its own
            return
        if t.is_contiguous():
            extent, dense = n, True
        else:
            extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            dense = extent == n
        try:
            start = t.data_ptr()
        except RuntimeError:  # a tensor without storage (a fake tensor, say): nothing to alias
            return
        self._starts.append(start)
        self._ends.append(start + extent * t.element_size())
        self._dense.append(dense)
        self._tensors.append(tensor)
        self._params.append(param)
        self._keys.append(key)

    def check(self) -> None:
        """A sweep over the spans in address order: O(n log n), and disjoint memory keeps one
        span open. (Addresses are unique across devices, but compared only on one.)"""
        starts, ends = self._starts, self._ends
        open_spans: list[int] = []
        open_end = -1
        for i in sorted(range(len(starts)), key=starts.__getitem__):
            if starts[i] >= open_end:
                open_spans, open_end = [i], ends[i]
                continue
            open_spans = [j for j in open_spans if ends[j] > starts[i]]
            for j in open_spans:
                self._refuse_if_shared(i, j)
            open_spans.append(i)
            open_end = max(open_end, ends[i])

    def _refuse_if_shared(self, i: int, j: int) -> None:
        i, j = max(i, j), min(i, j)  # the later claim named first: the same in every run
        if self._params[i] is self._params[j] and self._keys[i] == self._keys[j]:
            return  # one tensor added twice for one owner
        a, b = self._tensors[i], self._tensors[j]
        a_local, b_local = local(a), local(b)
        if a_local.device == b_local.device and (
                (self._dense[i] and self._dense[j]) or _bytes_overlap(a_local, b_local)):
            raise SharedMemoryError((self._params[i], self._keys[i]),
                                    (self._params[j], self._keys[j]), a is b)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors with gaps (strided views) whose spans meet cover a byte in common."""
    if max(a.numel() * a.element_size(), b.numel() * b.element_size()) > _EXACT_BYTES:
        return True
    return bool(torch.isin(_bytes_of(a), _bytes_of(b)).any())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    offsets = torch.arange(extent, dtype=torch.int64).as_strided(t.shape, t.stride()).flatten()
    first = offsets * t.element_size() + t.data_ptr()
    return (first[:, None] + torch.arange(t.element_size())).flatten()
