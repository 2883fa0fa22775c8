// The engine tests' shared fixture: stories260K (model, tokenizer, W_O factors) loaded once per
// binary, the trained LKV artifact when it matches the model, and REQUIRE_MODEL_OR_SKIP(), which
// prints a skip message when the model folder is missing and FAILs when it is present but broken.
#pragma once

#include <doctest/doctest.h>

#include "../../examples/engine/evict.hpp"
#include "../../examples/engine/model_path.hpp"
#include "../../examples/engine/tokenizer.hpp"

#include <kvevict/io/lkv_artifact.hpp>

#include <string>

namespace kvevict_engine_test {

struct engine_fixture {
    std::string dir = kvevict_engine::resolve_model_dir();
    bool available = false;
    std::string error;
    kvevict_engine::model m;
    kvevict_engine::tokenizer tok;
    kvevict_engine::wo_factors wo;
    kvevict::io::lkv_artifact art;  ///< artifacts/lkv/stories260K.lkv, when have_lkv
    bool have_lkv = false;
    engine_fixture() {
        using namespace kvevict_engine;
        if (!model_dir_exists(dir)) return;
        if (auto r = load_model(model_file(dir), m); !r) { error = r.error; return; }
        if (auto r = tok.load(tokenizer_file(dir), m.cfg.vocab_size); !r) { error = r.error; return; }
        if (auto r = wo.compute(m); !r) { error = r.error; return; }
        available = true;
        const std::string path = std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
        kvevict::io::lkv_model_identity id;
        have_lkv = kvevict::io::read_lkv_artifact(path.c_str(), &art).ok() &&
                   kvevict::io::checkpoint_identity(model_file(dir).c_str(), &id).ok() && kvevict::io::check_model(art, id).ok();
    }
};

/// The binary's one fixture (loaded on first use).
inline const engine_fixture& fx() {
    static engine_fixture f;
    return f;
}

}  // namespace kvevict_engine_test

#define REQUIRE_MODEL_OR_SKIP()                                                                                      \
    if (!::kvevict_engine_test::fx().available) {                                                                    \
        if (!::kvevict_engine_test::fx().error.empty())                                                              \
            FAIL("model folder '" << ::kvevict_engine_test::fx().dir << "' present but failed: "                     \
                                  << ::kvevict_engine_test::fx().error);                                             \
        MESSAGE("skipping: model folder '" << ::kvevict_engine_test::fx().dir << "' not found (set KVEVICT_MODEL_DIR)"); \
        return;                                                                                                      \
    }
