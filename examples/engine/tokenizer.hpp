// kvevict_engine: llama2.c tokenizer (tok*.bin): greedy best-score BPE merging with byte fallback.
#pragma once

#include "model.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvevict_engine {

/// llama2.c tokenizer. Ids: 0 <unk>, 1 BOS, 2 EOS, 3..258 byte pieces <0x00>..<0xFF> (in tok512.bin).
class tokenizer {
public:
    static constexpr int bos = 1;
    static constexpr int eos = 2;

    /// Loads `path` (int32 max_token_length, then `vocab_size` records {float32 score, int32 len, len bytes}).
    /// `vocab_size` must be the model's vocabulary size. Errors: missing file, truncated record,
    /// negative/oversized piece length, trailing bytes after the last record. On failure *this is unchanged.
    load_result load(const std::string& path, int vocab_size) {
        std::vector<char> b;
        std::string err;
        if (!detail::read_file(path, b, err)) return result::failure(err);
        if (vocab_size <= 0) return result::failure("tokenizer: vocab_size must be positive");
        size_t off = 0;
        auto get = [&](void* dst, size_t n) {
            if (off + n > b.size()) return false;
            std::memcpy(dst, b.data() + off, n);
            off += n;
            return true;
        };
        std::int32_t max_len = 0;
        if (!get(&max_len, 4)) return result::failure("truncated tokenizer file '" + path + "' (no header)");
        std::vector<std::string> pieces(static_cast<size_t>(vocab_size));
        std::vector<float> scores(static_cast<size_t>(vocab_size));
        for (int i = 0; i < vocab_size; ++i) {
            std::int32_t len = 0;
            if (!get(&scores[size_t(i)], 4) || !get(&len, 4))
                return result::failure("truncated tokenizer file '" + path + "' at record " + std::to_string(i));
            if (len < 0 || len > 1024)
                return result::failure("bad tokenizer file '" + path + "': record " + std::to_string(i) +
                                       " has length " + std::to_string(len));
            pieces[size_t(i)].resize(size_t(len));
            if (len > 0 && !get(&pieces[size_t(i)][0], size_t(len)))
                return result::failure("truncated tokenizer file '" + path + "' at record " + std::to_string(i));
        }
        if (off != b.size())
            return result::failure("tokenizer file '" + path + "' has " + std::to_string(b.size() - off) +
                                   " trailing bytes after " + std::to_string(vocab_size) + " records (wrong vocab_size?)");
        vocab_ = std::move(pieces);
        scores_ = std::move(scores);
        max_token_length_ = max_len;
        lookup_.clear();
        for (int i = 0; i < vocab_size; ++i) lookup_.emplace(vocab_[size_t(i)], i);  // first id wins on duplicates
        return result::success();
    }

    int vocab_size() const { return int(vocab_.size()); }
    /// Raw piece text of `id` (precondition: 0 <= id < vocab_size()).
    const std::string& piece(int id) const { return vocab_[size_t(id)]; }
    float score(int id) const { return scores_[size_t(id)]; }
    /// Longest piece length in bytes, as stored in the file header.
    int max_token_length() const { return max_token_length_; }
    /// Id of an exact piece, or -1.
    int find(const std::string& s) const {
        auto it = lookup_.find(s);
        return it == lookup_.end() ? -1 : it->second;
    }

    /// Encodes UTF-8 `text` as llama2.c does: [BOS], the " " piece as dummy prefix if text is non-empty,
    /// one piece per UTF-8 character (at most 4 bytes; unknown characters fall back to byte ids byte+3),
    /// then repeatedly merges the adjacent pair whose concatenation is a piece with the highest score
    /// (first such pair on ties), [EOS]. Requires a loaded tokenizer.
    std::vector<int> encode(const std::string& text, bool add_bos = true, bool add_eos = false) const {
        std::vector<int> t;
        if (add_bos) t.push_back(bos);
        auto push_bytes = [&](const std::string& s) {
            int id = find(s);
            if (id >= 0) { t.push_back(id); return; }
            for (unsigned char c : s) t.push_back(int(c) + 3);
        };
        if (!text.empty()) push_bytes(" ");
        std::string buf;
        for (size_t i = 0; i < text.size(); ++i) {
            buf.push_back(text[i]);
            const bool next_is_continuation = i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
            if (next_is_continuation && buf.size() < 4) continue;
            push_bytes(buf);
            buf.clear();
        }
        const size_t first = add_bos ? 1 : 0;  // never merge BOS
        for (;;) {
            float best = -1e10f;
            int best_id = -1;
            size_t best_i = 0;
            for (size_t i = first; i + 1 < t.size(); ++i) {
                int id = find(vocab_[size_t(t[i])] + vocab_[size_t(t[i + 1])]);
                if (id >= 0 && scores_[size_t(id)] > best) { best = scores_[size_t(id)]; best_id = id; best_i = i; }
            }
            if (best_id < 0) break;
            t[best_i] = best_id;
            t.erase(t.begin() + long(best_i) + 1);
        }
        if (add_eos) t.push_back(eos);
        return t;
    }

    /// Text of `token` when it follows `prev`: a leading space is stripped after BOS, and byte pieces
    /// "<0xXX>" become the raw byte. Out-of-range ids decode to "".
    std::string decode_piece(int prev, int token) const {
        if (token < 0 || token >= vocab_size()) return {};
        const std::string& p = vocab_[size_t(token)];
        if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>') {
            auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
            int hi = hex(p[3]), lo = hex(p[4]);
            if (hi >= 0 && lo >= 0) return std::string(1, char(hi * 16 + lo));
        }
        if (prev == bos && !p.empty() && p[0] == ' ') return p.substr(1);
        return p;
    }

    /// Decodes a token list; `prev` is the token before ids[0] (pass bos for a continuation of [BOS]).
    /// BOS/EOS tokens inside `ids` produce no text.
    std::string decode(const std::vector<int>& ids, int prev = -1) const {
        std::string s;
        for (int id : ids) {
            if (id != bos && id != eos) s += decode_piece(prev, id);
            prev = id;
        }
        return s;
    }

private:
    std::vector<std::string> vocab_;
    std::vector<float> scores_;
    std::unordered_map<std::string, int> lookup_;
    int max_token_length_ = 0;
};

}  // namespace kvevict_engine
