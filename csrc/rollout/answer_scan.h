// One pass over a /generate answer (JSON bytes) that lifts out its two per-token arrays:
// "output_ids" (ints -> int32) at the top level and meta_info's "output_token_logprobs"
// (element 0 of each entry -> float32). What is left (the answer with those two arrays emptied
// to []) is small, and Python decodes it with orjson. The reference is the orjson path in
// areal_fast/rollout/answer.py; anything this scanner would not decode exactly as the reference
// does (invalid JSON, a duplicate key, a non-number log-prob, an id outside int32, ...)
// makes it answer "not handled" with a reason, and the caller takes the reference path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace areal {

struct AnswerScan {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::string rest;             // the answer with both arrays' contents removed
  const char* reason = nullptr;  // set when not handled (a static string)
};

// Scan n bytes at data. Returns true when handled (ids, logprobs, rest filled); false with
// out.reason otherwise. Never reads outside [data, data + n). The answer's rules (the reference's,
// areal_fast/rollout/answer.py): ids in [0, vocab) (vocab <= 0: unknown, ids >= 0), log-probs
// finite and <= 0, each log-prob entry [logprob, id, ...] naming the output id at its place,
// no duplicate key in any object.
bool scan_generate_answer(const char* data, std::size_t n, AnswerScan& out, int64_t vocab = 0);

}  // namespace areal
