// LKV rows of the fidelity report (registry: methods.hpp; design: docs/lkv.md).
//
// The trained tables come from the committed artifact artifacts/lkv/stories260K.lkv
// (tools/lkv/train.py), or from $KVEVICT_LKV_ARTIFACT. Rows (all at the report's keep fractions;
// budgets count every kept token):
//   LKV              learned head budgets (LKV-H) + learned token scorer (LKV-T), nothing forced
//   Uniform+LKV-T    uniform per-head budgets + the learned scorer      (ablation of LKV-H)
//   AdaKV+LKV-T      AdaKV head-wise budgets (alpha 0.2) + the learned scorer
//   LKV-H+ReST-KV    learned budgets + ReST-KV's scorer/smoothers (window 32 protected)
//   LKV-H+SnapKV     learned budgets + SnapKV attention-weight scores (window 32 protected);
//                    compare with the built-in SnapKV (uniform) and AdaKV rows.
// When the artifact cannot be read or belongs to another model shape, the rows are not
// registered and a note goes to stderr (the rest of the report is unaffected).
#include "methods.hpp"

#include <kvevict/backends/cpu/learned.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using adakv_lkv_t = kvevict::eviction_policy<kvevict::scorers::learned_mlp, kvevict::temporal::last, kvevict::spatial::none,
                                             kvevict::budgeters::adakv>;

const kvevict::io::lkv_artifact* load_artifact() {
    static kvevict::io::lkv_artifact art;
    const char* env = std::getenv("KVEVICT_LKV_ARTIFACT");
    const std::string path = env && *env ? std::string(env) : std::string(KVEVICT_SOURCE_DIR) + "/artifacts/lkv/stories260K.lkv";
    const kvevict::status s = kvevict::io::read_lkv_artifact(path.c_str(), &art);
    if (!s.ok()) {
        std::fprintf(stderr, "kvevict_fidelity: LKV rows skipped: %s\n", s.message());
        return nullptr;
    }
    return &art;
}

bool register_lkv_rows() {
    const kvevict::io::lkv_artifact* a = load_artifact();
    if (!a) return false;
    using kvevict_engine::policy_method;
    using kvevict_fidelity::method_registry;
    method_registry().push_back({100, policy_method<kvevict::lkv::full>("LKV", kvevict::lkv::full_params(*a), 0)});
    method_registry().push_back({101, policy_method<kvevict::lkv::uniform_budgets>("Uniform+LKV-T", kvevict::lkv::uniform_budgets_params(*a), 0)});
    adakv_lkv_t::params ap = adakv_lkv_t::defaults();
    ap.scorer = kvevict::io::scorer_params(*a);
    ap.selector.num_recent = 0;
    method_registry().push_back({102, policy_method<adakv_lkv_t>("AdaKV+LKV-T", ap, 0)});
    method_registry().push_back({103, policy_method<kvevict::lkv::budgets_restkv>("LKV-H+ReST-KV", kvevict::lkv::budgets_restkv_params(*a), 32)});
    method_registry().push_back({104, policy_method<kvevict::lkv::budgets_attention>("LKV-H+SnapKV", kvevict::lkv::budgets_attention_params(*a), 32)});
    return true;
}

const bool lkv_rows_registered = register_lkv_rows();

}  // namespace
