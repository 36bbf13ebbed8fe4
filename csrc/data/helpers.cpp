// Dataset index builders for megatron_lite.data (GPT samples and blending).
// They are sequential walks over millions of entries: trivial in C++, slow as
// Python loops. Registered as torch.ops.megatron_lite.build_sample_index and
// torch.ops.megatron_lite.build_blending_indices; numpy arrays cross via
// torch.from_numpy / .numpy() without copies.
// ATen's tensor and op headers and torch/library.h only: torch/extension.h (all of torch's C++ API and its
// Python bindings) took ~3x as long to compile, and nothing here needs Python.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// Row i of the result is (position in document_index, token offset in that
// document) where sample i starts. Sample i spans seq_length + 1 tokens, so
// sample i + 1 starts on sample i's last token: neighbours share one token.
// Rows: num_samples + 1 (the last row is where the final sample ends).
at::Tensor build_sample_index(const at::Tensor& sequence_lengths, const at::Tensor& document_index,
                                 int64_t seq_length, int64_t num_samples) {
  TORCH_CHECK(sequence_lengths.dtype() == at::kInt && sequence_lengths.dim() == 1 &&
                  sequence_lengths.is_contiguous(),
              "build_sample_index: sequence_lengths must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(document_index.dtype() == at::kInt && document_index.dim() == 1 && document_index.is_contiguous(),
              "build_sample_index: document_index must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(seq_length > 0 && num_samples >= 0, "build_sample_index: seq_length ", seq_length,
              " must be positive and num_samples ", num_samples, " non-negative");
  const int32_t* sizes = sequence_lengths.data_ptr<int32_t>();
  const int32_t* docs = document_index.data_ptr<int32_t>();
  const int64_t num_sizes = sequence_lengths.size(0);
  const int64_t num_docs = document_index.size(0);

  auto result = at::empty({num_samples + 1, 2}, at::kLong);
  int64_t* out = result.data_ptr<int64_t>();
  int64_t doc_position = 0;
  int64_t doc_offset = 0;
  out[0] = 0;
  out[1] = 0;
  for (int64_t sample = 1; sample <= num_samples; ++sample) {
    // A sample is seq_length + 1 tokens counted from the current position.
    int64_t remaining = seq_length + 1;
    while (true) {
      TORCH_CHECK_VALUE(doc_position < num_docs, "build_sample_index: the document index holds fewer than ",
                        num_samples * seq_length + 1, " tokens for ", num_samples, " samples of ", seq_length);
      const int32_t doc = docs[doc_position];
      TORCH_CHECK(doc >= 0 && doc < num_sizes, "build_sample_index: document ", doc, " out of range");
      const int64_t available = sizes[doc] - doc_offset;
      if (available >= remaining) {
        // The sample's last token is in this document; the next sample starts on it.
        doc_offset += remaining - 1;
        break;
      }
      remaining -= available;
      ++doc_position;
      doc_offset = 0;
    }
    out[2 * sample] = doc_position;
    out[2 * sample + 1] = doc_offset;
  }
  return result;
}

// Greedy interleaving: each next sample goes to the dataset furthest below
// its target share, so every prefix of the result is close to the weights.
std::tuple<at::Tensor, at::Tensor> build_blending_indices(const at::Tensor& weights, int64_t size) {
  TORCH_CHECK(weights.dtype() == at::kDouble && weights.dim() == 1 && weights.is_contiguous(),
              "build_blending_indices: weights must be a contiguous 1-D float64 tensor");
  const int64_t num_datasets = weights.size(0);
  TORCH_CHECK(num_datasets > 0 && num_datasets < 32768, "build_blending_indices: 1 to 32767 datasets, got ",
              num_datasets);
  TORCH_CHECK(size >= 0, "build_blending_indices: size must be non-negative, got ", size);
  const double* w = weights.data_ptr<double>();
  auto dataset_index = at::empty({size}, at::kShort);
  auto dataset_sample_index = at::empty({size}, at::kLong);
  int16_t* which = dataset_index.data_ptr<int16_t>();
  int64_t* position = dataset_sample_index.data_ptr<int64_t>();
  std::vector<int64_t> taken(num_datasets, 0);
  for (int64_t i = 0; i < size; ++i) {
    const double expected = static_cast<double>(i > 0 ? i : 1);
    int64_t best = 0;
    double best_error = w[0] * expected - static_cast<double>(taken[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error = w[d] * expected - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    which[i] = static_cast<int16_t>(best);
    position[i] = taken[best]++;
  }
  return {dataset_index, dataset_sample_index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_lite, m) {
  m.def("build_sample_index(Tensor sequence_lengths, Tensor document_index, int seq_length, int num_samples) -> Tensor");
  m.def("build_blending_indices(Tensor weights, int size) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_lite, CPU, m) {
  m.impl("build_sample_index", &build_sample_index);
  m.impl("build_blending_indices", &build_blending_indices);
}
