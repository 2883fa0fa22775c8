// kvevict_engine: where to find the stories260K model folder.
#pragma once

#include <cstdlib>
#include <string>
#include <filesystem>
#include <system_error>

namespace kvevict_engine {

/// Resolves the model folder, first match wins:
///   1. `flag_value` if non-empty (e.g. from --model DIR);
///   2. environment variable KVEVICT_MODEL_DIR if set and non-empty;
///   3. KVEVICT_SOURCE_DIR "/../shared/models/stories260K" when the compile definition KVEVICT_SOURCE_DIR
///      (a string literal: the repository root) is present;
///   4. "../shared/models/stories260K" relative to the current working directory.
/// Does not check that the folder exists (see model_dir_exists).
inline std::string resolve_model_dir(const std::string& flag_value = {}) {
    if (!flag_value.empty()) return flag_value;
    if (const char* env = std::getenv("KVEVICT_MODEL_DIR"); env && *env) return env;
#ifdef KVEVICT_SOURCE_DIR
    return std::string(KVEVICT_SOURCE_DIR) + "/../shared/models/stories260K";
#else
    return "../shared/models/stories260K";
#endif
}

/// Checkpoint file inside a model folder.
inline std::string model_file(const std::string& dir) { return dir + "/stories260K.bin"; }
/// Tokenizer file inside a model folder.
inline std::string tokenizer_file(const std::string& dir) { return dir + "/tok512.bin"; }

/// True when `dir` is a directory containing both the checkpoint and the tokenizer.
inline bool model_dir_exists(const std::string& dir) {
    std::error_code ec;
    return std::filesystem::is_directory(dir, ec) && std::filesystem::is_regular_file(model_file(dir), ec) &&
           std::filesystem::is_regular_file(tokenizer_file(dir), ec);
}

}  // namespace kvevict_engine
