#include "rollout/answer_scan.h"

#include <cfloat>
#include <charconv>
#include <cstring>
#include <forward_list>
#include <string_view>
#include <utility>

#if !(defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L)
#include <cerrno>
#include <clocale>
#include <cstdlib>
#include <locale.h>
#endif

namespace areal {
namespace {

// Nesting deeper than this is left to the reference (orjson stops at 1024 levels).
constexpr int kMaxDepth = 200;
// Integer literals longer than this are left to the reference (they do not fit in int64).
constexpr std::ptrdiff_t kMaxIntDigits = 18;
// Objects with more keys than this are left to the reference (the duplicate check here is
// quadratic in the keys of one object; answers have ~15).
constexpr int kMaxKeys = 64;

struct Fail {
  const char* reason;
};

#if !(defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L)
// A standard library without floating-point from_chars: strtod in the C locale, never the
// process locale (a "," decimal separator would misread every log-prob).
locale_t c_locale() {
  static locale_t loc = newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(0));
  return loc;
}
#endif

// The keys of one object so far, to refuse a duplicate (the reference refuses every duplicate
// key; orjson would keep the last). Unescaped keys are views of the answer; decoded ones are
// owned here (a forward_list: stable addresses, no allocation while empty).
class KeySet {
 public:
  // The key as a view that outlives the next key read; sets *dup when it was seen before.
  std::string_view add(std::string_view key, bool escaped, bool* dup) {
    if (n_ == kMaxKeys) throw Fail{"an object with too many keys"};
    if (escaped) {
      owned_.emplace_front(key);
      key = owned_.front();
    }
    *dup = false;
    for (int i = 0; i < n_; ++i) {
      if (keys_[i] == key) *dup = true;
    }
    keys_[n_++] = key;
    return key;
  }

 private:
  std::string_view keys_[kMaxKeys];
  int n_ = 0;
  std::forward_list<std::string> owned_;
};

class Scanner {
 public:
  Scanner(const char* data, std::size_t n, int64_t vocab) : begin_(data), p_(data), end_(data + n), vocab_(vocab) {}

  void run(AnswerScan& out) {
    ws();
    bool seen_ids = false, seen_meta = false;
    walk_object({"top level is not an object", "truncated", "expected , or } in the top-level object"},
                [&](std::string_view key) {
                  if (key == "output_ids") {
                    if (seen_ids) throw Fail{"duplicate key output_ids"};
                    seen_ids = true;
                    read_ids(out.ids);
                  } else if (key == "meta_info") {
                    if (seen_meta) throw Fail{"duplicate key meta_info"};
                    seen_meta = true;
                    read_meta(out.logprobs);
                  } else {
                    skip_value(1, false);
                  }
                });
    ws();
    if (more()) throw Fail{"bytes after the top-level object"};
    if (!seen_ids) throw Fail{"no output_ids"};
    if (!seen_meta) throw Fail{"no meta_info"};
    // Each log-prob entry names its token: it must be the output id at its place (a length
    // mismatch is the caller's to report, in the reference's words).
    if (entry_ids_.size() == out.ids.size()) {
      for (std::size_t i = 0; i < entry_ids_.size(); ++i) {
        if (entry_ids_[i] != out.ids[i]) throw Fail{"a log-prob entry's token id differs from output_ids"};
      }
    }
    // The rest: the answer without the contents of the (at most two) arrays read above.
    std::size_t removed = 0;
    for (int i = 0; i < n_cuts_; ++i) removed += cuts_[i].second - cuts_[i].first;
    out.rest.reserve(static_cast<std::size_t>(end_ - begin_) - removed);
    const char* from = begin_;
    for (int i = 0; i < n_cuts_; ++i) {
      out.rest.append(from, cuts_[i].first);
      from = cuts_[i].second;
    }
    out.rest.append(from, end_);
  }

 private:
  const char* const begin_;
  const char* p_;
  const char* const end_;
  std::pair<const char*, const char*> cuts_[2];
  int n_cuts_ = 0;
  const int64_t vocab_;  // > 0: ids must be below it
  std::vector<int64_t> entry_ids_;  // element 1 of each log-prob entry
  std::string key_;  // the last escaped key, decoded

  bool more() const { return p_ < end_; }

  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }

  void expect(char c) {
    if (!more() || *p_ != c) throw Fail{"invalid JSON (unexpected byte)"};
    ++p_;
  }

  void literal(const char* word, std::size_t len) {
    if (static_cast<std::size_t>(end_ - p_) < len || std::memcmp(p_, word, len) != 0)
      throw Fail{"invalid JSON (bad literal)"};
    p_ += len;
  }

  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // The continuation bytes of a UTF-8 sequence led by c (>= 0x80), strictly: no overlong form,
  // no surrogate, nothing past U+10FFFF.
  void utf8_tail(unsigned char c) {
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      throw Fail{"invalid UTF-8 inside a per-token array"};
    }
    if (end_ - p_ < need) throw Fail{"truncated string"};
    for (int i = 0; i < need; ++i) {
      const unsigned char b = static_cast<unsigned char>(p_[i]);
      if (b < lo || b > hi) throw Fail{"invalid UTF-8 inside a per-token array"};
      lo = 0x80;
      hi = 0xBF;
    }
    p_ += need;
  }

  // A string at p_ (the opening quote). `removed`: it lies inside an array whose bytes will not
  // reach orjson, so every check orjson would make must be made here: valid UTF-8 and surrogate
  // escapes only in pairs. Returns true when it held an escape.
  bool string(bool removed) {
    expect('"');
    bool escaped = false;
    for (;;) {
      if (!more()) throw Fail{"truncated string"};
      const unsigned char c = static_cast<unsigned char>(*p_++);
      if (c == '"') return escaped;
      if (c < 0x20) throw Fail{"control character in a string"};
      if (c >= 0x80 && removed) utf8_tail(c);
      if (c != '\\') continue;
      escaped = true;
      if (!more()) throw Fail{"truncated escape"};
      const char e = *p_++;
      switch (e) {
        case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
          break;
        case 'u': {
          if (end_ - p_ < 4) throw Fail{"truncated \\u escape"};
          int v = 0;
          for (int i = 0; i < 4; ++i) {
            const int h = hex(p_[i]);
            if (h < 0) throw Fail{"bad \\u escape"};
            v = v * 16 + h;
          }
          p_ += 4;
          if (!removed || v < 0xD800 || v > 0xDFFF) break;
          // A surrogate escape must be a high one followed at once by a low one.
          if (v >= 0xDC00 || end_ - p_ < 6 || p_[0] != '\\' || p_[1] != 'u')
            throw Fail{"lone surrogate escape inside a per-token array"};
          int lo = 0;
          for (int i = 2; i < 6; ++i) {
            const int h = hex(p_[i]);
            if (h < 0) throw Fail{"bad \\u escape"};
            lo = lo * 16 + h;
          }
          if (lo < 0xDC00 || lo > 0xDFFF) throw Fail{"lone surrogate escape inside a per-token array"};
          p_ += 6;
          break;
        }
        default:
          throw Fail{"bad escape"};
      }
    }
  }

  static void put_utf8(std::string& out, uint32_t v) {
    if (v < 0x80) {
      out.push_back(static_cast<char>(v));
    } else if (v < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (v >> 6)));
      out.push_back(static_cast<char>(0x80 | (v & 0x3F)));
    } else if (v < 0x10000) {  // a lone surrogate too (as the reference keeps it: never equal to another)
      out.push_back(static_cast<char>(0xE0 | (v >> 12)));
      out.push_back(static_cast<char>(0x80 | ((v >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (v & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (v >> 18)));
      out.push_back(static_cast<char>(0x80 | ((v >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((v >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (v & 0x3F)));
    }
  }

  // An object key, its escapes decoded exactly (to UTF-8: the duplicate check compares code
  // points, as the reference does). *escaped: it held an escape (the view is then key_).
  std::string_view key_string(bool removed, bool* escaped) {
    if (!more() || *p_ != '"') throw Fail{"invalid JSON (expected a key)"};
    const char* start = p_ + 1;
    *escaped = string(removed);
    std::string_view raw(start, static_cast<std::size_t>(p_ - 1 - start));
    if (!*escaped) return raw;
    key_.clear();
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] != '\\') {
        key_.push_back(raw[i]);
        continue;
      }
      const char e = raw[++i];  // string() checked every escape
      switch (e) {
        case 'b': key_.push_back('\b'); break;
        case 'f': key_.push_back('\f'); break;
        case 'n': key_.push_back('\n'); break;
        case 'r': key_.push_back('\r'); break;
        case 't': key_.push_back('\t'); break;
        case 'u': {
          uint32_t v = 0;
          for (int k = 1; k <= 4; ++k) v = v * 16 + static_cast<uint32_t>(hex(raw[i + k]));
          i += 4;
          if (v >= 0xD800 && v < 0xDC00 && i + 6 < raw.size() &&
              raw[i + 1] == '\\' && raw[i + 2] == 'u') {
            uint32_t lo = 0;
            bool ok = true;
            for (int k = 3; k <= 6; ++k) {
              const int h = hex(raw[i + k]);
              if (h < 0) ok = false;
              lo = lo * 16 + static_cast<uint32_t>(h < 0 ? 0 : h);
            }
            if (ok && lo >= 0xDC00 && lo <= 0xDFFF) {
              v = 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
              i += 6;
            }
          }
          put_utf8(key_, v);
          break;
        }
        default: key_.push_back(e);  // " \\ /
      }
    }
    return key_;
  }

  struct Number {
    const char* start;
    const char* end;
    bool integer;  // no fraction, no exponent
  };

  // A JSON number at p_, by the grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  Number number() {
    Number n{p_, nullptr, true};
    if (more() && *p_ == '-') ++p_;
    if (!more()) throw Fail{"truncated number"};
    if (*p_ == '0') {
      ++p_;
    } else if (*p_ >= '1' && *p_ <= '9') {
      while (more() && *p_ >= '0' && *p_ <= '9') ++p_;
    } else {
      throw Fail{"invalid JSON (not a value)"};
    }
    if (more() && *p_ == '.') {
      n.integer = false;
      ++p_;
      if (!more() || *p_ < '0' || *p_ > '9') throw Fail{"invalid number"};
      while (more() && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    if (more() && (*p_ == 'e' || *p_ == 'E')) {
      n.integer = false;
      ++p_;
      if (more() && (*p_ == '+' || *p_ == '-')) ++p_;
      if (!more() || *p_ < '0' || *p_ > '9') throw Fail{"invalid number"};
      while (more() && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    n.end = p_;
    return n;
  }

  static int64_t to_int64(const Number& n) {
    const std::ptrdiff_t digits = n.end - n.start - (*n.start == '-' ? 1 : 0);
    if (digits > kMaxIntDigits) throw Fail{"integer too long"};
    int64_t v = 0;
    auto r = std::from_chars(n.start, n.end, v);
    if (r.ec != std::errc() || r.ptr != n.end) throw Fail{"bad integer"};
    return v;
  }

  // The reference turns a JSON float into the nearest double, an integer into a Python int,
  // and array('f') rounds either to float via double; -0 as an integer is +0.0.
  static float to_float(const Number& n) {
    double d;
    if (n.integer) {
      d = static_cast<double>(to_int64(n));
    } else {
#if defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
      auto r = std::from_chars(n.start, n.end, d);
      if (r.ec != std::errc() || r.ptr != n.end) throw Fail{"log-prob out of double range"};
#else
      std::string s(n.start, n.end);
      char* stop = nullptr;
      errno = 0;
      d = strtod_l(s.c_str(), &stop, c_locale());
      if (errno != 0 || stop != s.c_str() + s.size()) throw Fail{"log-prob out of double range"};
#endif
    }
    if (!(d <= FLT_MAX && d >= -FLT_MAX)) throw Fail{"log-prob out of float range"};
    return static_cast<float>(d);
  }

  void skip_value(int depth, bool removed) {
    if (depth > kMaxDepth) throw Fail{"nested too deep"};
    if (!more()) throw Fail{"truncated"};
    switch (*p_) {
      case '"':
        string(removed);
        return;
      case 'n': literal("null", 4); return;
      case 't': literal("true", 4); return;
      case 'f': literal("false", 5); return;
      case '[':
        walk('[', ']', {"invalid JSON", "truncated array", "expected , or ] in an array"},
             [&] { skip_value(depth + 1, removed); });
        return;
      case '{': {
        KeySet keys;
        walk('{', '}', {"invalid JSON", "truncated object", "expected , or } in an object"}, [&] {
          bool escaped = false, dup = false;
          const std::string_view key = key_string(removed, &escaped);
          keys.add(key, escaped, &dup);
          if (dup) throw Fail{"duplicate key"};
          ws();
          expect(':');
          ws();
          skip_value(depth + 1, removed);
        });
        return;
      }
      default: {
        const Number n = number();
        // Inside a cut array orjson never sees this number: refuse what it might reject
        // (a float that overflows a double, an integer past 64 bits).
        if (!removed) return;
        if (n.integer) {
          if (n.end - n.start - (*n.start == '-' ? 1 : 0) > kMaxIntDigits) throw Fail{"integer too long"};
        } else {
          to_float(n);
        }
        return;
      }
    }
  }

  // What a bracketed value's shape errors say (static strings: the decline reason).
  struct Reasons {
    const char* not_open;
    const char* truncated;
    const char* separator;
  };

  // open elem , elem ... close (or open close), each element read by read_elem() from its first
  // byte; returns where the contents start (after the opening bracket).
  template <class ReadElem>
  const char* walk(char open, char close, const Reasons& r, ReadElem read_elem) {
    if (!more() || *p_ != open) throw Fail{r.not_open};
    ++p_;
    const char* inside = p_;
    ws();
    if (more() && *p_ == close) {
      ++p_;
      return inside;
    }
    for (;;) {
      ws();
      read_elem();
      ws();
      if (!more()) throw Fail{r.truncated};
      if (*p_ == ',') { ++p_; continue; }
      if (*p_ == close) { ++p_; return inside; }
      throw Fail{r.separator};
    }
  }

  // { "key": value, ... } with each value read by on_value(key) from its first byte.
  // A duplicate key is refused after on_value, which refuses the keys it reads in its own words.
  template <class OnValue>
  void walk_object(const Reasons& r, OnValue on_value) {
    KeySet keys;
    walk('{', '}', r, [&] {
      bool escaped = false, dup = false;
      const std::string_view raw_key = key_string(false, &escaped);
      const std::string_view key = keys.add(raw_key, escaped, &dup);
      ws();
      expect(':');
      ws();
      on_value(key);
      if (dup) throw Fail{"duplicate key"};
    });
  }

  // An array read by walk() whose contents (between the brackets) are cut from the rest.
  template <class ReadElem>
  void read_cut_array(const Reasons& r, ReadElem read_elem) {
    const char* from = walk('[', ']', r, read_elem);
    cuts_[n_cuts_++] = {from, p_ - 1};
  }

  // "[ int, int, ... ]" -> ids.
  void read_ids(std::vector<int32_t>& ids) {
    // ~6 bytes a token in real answers ("12345,"): reserve once, not per push.
    ids.reserve(static_cast<std::size_t>(end_ - p_) / 8 + 1);
    read_cut_array({"output_ids is not an array", "truncated output_ids", "expected , or ] in output_ids"}, [&] {
      if (!more()) throw Fail{"truncated output_ids"};
      const char c = *p_;
      if (c != '-' && (c < '0' || c > '9')) throw Fail{"an output id is not a number"};
      const Number n = number();
      if (!n.integer) throw Fail{"an output id is not an integer"};
      const int64_t v = to_int64(n);
      if (v < INT32_MIN || v > INT32_MAX) throw Fail{"an output id is outside int32"};
      if (v < 0) throw Fail{"an output id is negative"};
      if (vocab_ > 0 && v >= vocab_) throw Fail{"an output id is outside the vocabulary"};
      ids.push_back(static_cast<int32_t>(v));
    });
  }

  void read_meta(std::vector<float>& lps) {
    bool seen = false;
    walk_object({"meta_info is not an object", "truncated meta_info", "expected , or } in meta_info"},
                [&](std::string_view key) {
                  if (key != "output_token_logprobs") {
                    skip_value(2, false);
                    return;
                  }
                  if (seen) throw Fail{"duplicate key output_token_logprobs"};
                  seen = true;
                  if (more() && *p_ == 'n') {
                    literal("null", 4);  // the reference reads null as no log-probs
                  } else {
                    read_logprobs(lps);
                  }
                });
  }

  // "[ [lp, id, ...], ... ]" -> element 0 of each entry; the other elements are only checked.
  void read_logprobs(std::vector<float>& lps) {
    // ~30 bytes an entry in real answers ("[-0.0123456789,12345,null],").
    lps.reserve(static_cast<std::size_t>(end_ - p_) / 24 + 1);
    entry_ids_.reserve(static_cast<std::size_t>(end_ - p_) / 24 + 1);
    read_cut_array({"output_token_logprobs is neither an array nor null", "truncated output_token_logprobs",
                    "expected , or ] in output_token_logprobs"}, [&] {
      if (!more() || *p_ != '[') throw Fail{"a log-prob entry is not an array"};
      ++p_;
      ws();
      if (!more()) throw Fail{"truncated log-prob entry"};
      const char c = *p_;
      if (c != '-' && (c < '0' || c > '9')) throw Fail{"a log-prob is not a number"};
      const float lp = to_float(number());
      if (lp > 0.0f) throw Fail{"a log-prob is positive"};  // after the float rounding, as the reference
      lps.push_back(lp);
      // element 1: the token's id, an integer (compared with output_ids at the end)
      ws();
      if (!more()) throw Fail{"truncated log-prob entry"};
      if (*p_ == ']') throw Fail{"a log-prob entry has no token id"};
      if (*p_ != ',') throw Fail{"expected , or ] in a log-prob entry"};
      ++p_;
      ws();
      if (!more()) throw Fail{"truncated log-prob entry"};
      if (*p_ != '-' && (*p_ < '0' || *p_ > '9')) throw Fail{"a log-prob entry's token id is not a number"};
      const Number id = number();
      if (!id.integer) throw Fail{"a log-prob entry's token id is not an integer"};
      entry_ids_.push_back(to_int64(id));
      for (;;) {
        ws();
        if (!more()) throw Fail{"truncated log-prob entry"};
        if (*p_ == ']') { ++p_; break; }
        if (*p_ != ',') throw Fail{"expected , or ] in a log-prob entry"};
        ++p_;
        ws();
        skip_value(4, true);
      }
    });
  }
};

}  // namespace

bool scan_generate_answer(const char* data, std::size_t n, AnswerScan& out, int64_t vocab) {
  out.ids.clear();
  out.logprobs.clear();
  out.rest.clear();
  out.reason = nullptr;
  try {
    Scanner(data, n, vocab).run(out);
    return true;
  } catch (const Fail& f) {
    out.reason = f.reason;
    return false;
  }
}

}  // namespace areal
