// WrittenMemory's methods (written_memory.h).
#include "written_memory.h"

#include <algorithm>
#include <utility>

#include "step_lists.h"

namespace pnm {
namespace {

// Two filters of hashed granules: a span of up to kSmallGranules 256-byte granules (the
// common small tensor: CPU and CUDA allocators pack those side by side, gradients among
// parameters, so that coarse granules would all be marked) marks those; a larger one marks
// 64 KiB granules. A gradient over more small granules than that is searched for at once (a
// held small span may lie inside it).
constexpr int kFineShift = 8;
constexpr int kCoarseShift = 16;
constexpr uintptr_t kSmallGranules = 16;

// The bytes a strided tensor's elements span (none without memory of its own: a meta tensor's
// storage has no data), in memory and from its storage's start (`in_storage`, if given).
// Read from the TensorImpl: thousands of gradients a step.
bool span_of(const at::Tensor& t, uintptr_t& begin, uintptr_t& end,
             StorageSpan* in_storage = nullptr) {
  if (!t.defined()) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->layout() != at::kStrided) return false;
  const int64_t numel = impl->numel();
  const c10::Storage& storage = impl->unsafe_storage();
  const void* data = storage.data();
  if (numel == 0 || data == nullptr) return false;
  int64_t extent = numel;
  if (!impl->is_contiguous()) {
    extent = 1;
    const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
    for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
  }
  const auto size = static_cast<uintptr_t>(impl->itemsize());
  const uintptr_t offset = static_cast<uintptr_t>(impl->storage_offset()) * size;
  begin = reinterpret_cast<uintptr_t>(data) + offset;
  end = begin + static_cast<uintptr_t>(extent) * size;
  if (in_storage != nullptr) {
    *in_storage = {reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl()), offset,
                   offset + (end - begin)};
  }
  return true;
}


inline uint64_t filter_slot(uintptr_t granule, int bits) {
  return (static_cast<uint64_t>(granule) * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}

inline uintptr_t granules_of(uintptr_t begin, uintptr_t end, int shift) {
  return ((end - 1) >> shift) - (begin >> shift) + 1;
}

inline bool is_small(uintptr_t begin, uintptr_t end) {
  return granules_of(begin, end, kFineShift) <= kSmallGranules;
}

}  // namespace

bool extents_meet(at::TensorList written, at::TensorList read) {
  const ExtentsMeet meet = where_extents_meet(written, read);
  return meet.among_written || meet.read_in_written;
}

ExtentsMeet where_extents_meet(at::TensorList written, at::TensorList read) {
  ExtentsMeet meet;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(written.size());
  uintptr_t begin = 0, end = 0;
  for (const at::Tensor& t : written) {
    if (span_of(t, begin, end)) spans.emplace_back(begin, end);
  }
  std::sort(spans.begin(), spans.end());
  // Merged as they are swept (touching or shared): the ends of the kept spans are sorted too.
  size_t kept = 0;
  for (const auto& s : spans) {
    if (kept > 0 && s.first <= spans[kept - 1].second) {
      meet.among_written |= s.first < spans[kept - 1].second;
      spans[kept - 1].second = std::max(spans[kept - 1].second, s.second);
    } else {
      spans[kept++] = s;
    }
  }
  spans.resize(kept);
  for (const at::Tensor& t : read) {
    if (!span_of(t, begin, end)) continue;
    const auto it = std::upper_bound(
        spans.begin(), spans.end(), begin,
        [](uintptr_t b, const std::pair<uintptr_t, uintptr_t>& s) { return b < s.second; });
    if (it != spans.end() && it->first < end) {
      meet.read_in_written = true;
      break;
    }
  }
  return meet;
}

void WrittenMemory::add_tensor(const at::Tensor& t) {
  uintptr_t begin = 0, end = 0;
  StorageSpan in_storage{};
  if (!span_of(t, begin, end, &in_storage)) return;
  spans_.push_back({begin, end});
  storage_spans_.push_back(in_storage);
  sealed_ = false;
}

void WrittenMemory::add(std::vector<at::Tensor> tensors) {
  for (const at::Tensor& t : tensors) add_tensor(t);
}

void WrittenMemory::add_lists(const c10::intrusive_ptr<StepLists>& lists) {
  for (const std::vector<at::Tensor>* list :
       {&lists->params, &lists->buffer0, &lists->buffer1, &lists->buffer2, &lists->buffer3,
        &lists->steps}) {
    for (const at::Tensor& t : *list) add_tensor(t);
  }
}

void WrittenMemory::clear() {
  spans_.clear();
  storage_spans_.clear();
  fine_ = Filter();
  coarse_ = Filter();
  storages_ = Filter();
  sealed_ = true;
}

void WrittenMemory::seal() {
  if (sealed_) return;
  std::sort(spans_.begin(), spans_.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  size_t kept = 0;
  for (const Span& s : spans_) {
    if (kept > 0 && s.begin <= spans_[kept - 1].end) {
      spans_[kept - 1].end = std::max(spans_[kept - 1].end, s.end);
    } else {
      spans_[kept++] = s;
    }
  }
  spans_.resize(kept);
  uintptr_t fine = 0, coarse = 0;
  for (const Span& s : spans_) {
    if (is_small(s.begin, s.end)) fine += granules_of(s.begin, s.end, kFineShift);
    else coarse += granules_of(s.begin, s.end, kCoarseShift);
  }
  fine_.size(fine);
  coarse_.size(coarse);
  for (const Span& s : spans_) {
    if (is_small(s.begin, s.end)) fine_.mark(s.begin, s.end, kFineShift);
    else coarse_.mark(s.begin, s.end, kCoarseShift);
  }
  // Storage by storage, merged likewise (so that each storage's ends are sorted too).
  std::sort(storage_spans_.begin(), storage_spans_.end(),
            [](const StorageSpan& a, const StorageSpan& b) {
              return a.storage != b.storage ? a.storage < b.storage : a.begin < b.begin;
            });
  kept = 0;
  uintptr_t storages = 0;
  for (const StorageSpan& s : storage_spans_) {
    StorageSpan* last = kept > 0 ? &storage_spans_[kept - 1] : nullptr;
    if (last != nullptr && last->storage == s.storage && s.begin <= last->end) {
      last->end = std::max(last->end, s.end);
    } else {
      storages += last == nullptr || last->storage != s.storage;
      storage_spans_[kept++] = s;
    }
  }
  storage_spans_.resize(kept);
  storages_.size(storages);
  for (const StorageSpan& s : storage_spans_) storages_.mark(s.storage, s.storage + 1, 0);
  sealed_ = true;
}

void WrittenMemory::Filter::size(uintptr_t granules) {
  // Eight bits or more a marked granule: few false hits, each costing only a search.
  bits = 10;
  while (bits < 26 && (uintptr_t{1} << bits) < 8 * granules) ++bits;
  words.assign((size_t{1} << bits) / 64, 0);
}

void WrittenMemory::Filter::mark(uintptr_t begin, uintptr_t end, int shift) {
  for (uintptr_t g = begin >> shift; g <= (end - 1) >> shift; ++g) {
    const uint64_t slot = filter_slot(g, bits);
    words[slot / 64] |= uint64_t{1} << (slot % 64);
  }
}

bool WrittenMemory::Filter::marked(uintptr_t begin, uintptr_t end, int shift) const {
  for (uintptr_t g = begin >> shift; g <= (end - 1) >> shift; ++g) {
    const uint64_t slot = filter_slot(g, bits);
    if ((words[slot / 64] >> (slot % 64)) & 1) return true;
  }
  return false;
}

bool WrittenMemory::meets(uintptr_t begin, uintptr_t end) const {
  if (is_small(begin, end) && !fine_.marked(begin, end, kFineShift) &&
      !coarse_.marked(begin, end, kCoarseShift)) {
    return false;
  }
  // The first span ending after `begin` (merged spans: their ends are sorted too).
  const auto it = std::upper_bound(spans_.begin(), spans_.end(), begin,
                                   [](uintptr_t b, const Span& s) { return b < s.end; });
  return it != spans_.end() && it->begin < end;
}

bool WrittenMemory::meets_in_storage(const StorageSpan& span) const {
  if (!storages_.marked(span.storage, span.storage + 1, 0)) return false;
  // The first span of that storage ending after span.begin.
  const auto it = std::upper_bound(
      storage_spans_.begin(), storage_spans_.end(), span,
      [](const StorageSpan& a, const StorageSpan& b) {
        return a.storage != b.storage ? a.storage < b.storage : a.begin < b.end;
      });
  return it != storage_spans_.end() && it->storage == span.storage && it->begin < span.end;
}

bool WrittenMemory::met(const at::Tensor& grad) const {
  uintptr_t begin = 0, end = 0;
  StorageSpan in_storage{};
  return span_of(grad, begin, end, &in_storage) &&
         (meets(begin, end) || meets_in_storage(in_storage));
}

int64_t WrittenMemory::first_met(const std::vector<at::Tensor>& grads) {
  seal();
  if (spans_.empty()) return -1;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (met(grads[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

bool WrittenMemory::params_grads_met(const c10::intrusive_ptr<HeldParams>& held) {
  seal();
  if (spans_.empty()) return false;
  for (const at::Tensor& p : held->params) {
    if (met(p.grad())) return true;
  }
  return false;
}

bool WrittenMemory::grads_met(std::vector<at::Tensor> grads) { return first_met(grads) >= 0; }

}  // namespace pnm
