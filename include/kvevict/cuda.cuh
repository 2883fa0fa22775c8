// kvevict CUDA backend: evictor<Policy, cuda::backend>, device compaction, KVEVICT_CUDA_TRY.
// Include from a .cu translation unit compiled by nvcc (C++17); link CUDA::cudart (the
// kvevict::cuda CMake target does both the include paths and the link). See docs/cuda.md.
#pragma once

#if !defined(__CUDACC__)
#error "kvevict/cuda.cuh must be compiled by nvcc (a .cu translation unit)"
#endif

#include "kvevict/kvevict.hpp"
#include "kvevict/backends/cuda/backend.cuh"
#include "kvevict/backends/cuda/compact.cuh"
#include "kvevict/backends/cuda/compact_paged.cuh"
#include "kvevict/backends/cuda/evictor.cuh"
#include "kvevict/backends/cuda/impl.cuh"
#include "kvevict/backends/cuda/paged.cuh"
#include "kvevict/backends/cuda/scorers.cuh"
#include "kvevict/backends/cuda/select.cuh"
#include "kvevict/backends/cuda/union_selections.cuh"
// The built-in stages' implementation traits (one file each; impl.cuh describes the traits).
#include "kvevict/backends/cuda/scorers/accumulated_attention.cuh"
#include "kvevict/backends/cuda/scorers/attention_weight.cuh"
#include "kvevict/backends/cuda/scorers/key_norm.cuh"
#include "kvevict/backends/cuda/scorers/last_query.cuh"
#include "kvevict/backends/cuda/scorers/learned_mlp.cuh"
#include "kvevict/backends/cuda/scorers/output_reconstruction.cuh"
#include "kvevict/backends/cuda/spatial/smoothers.cuh"
#include "kvevict/backends/cuda/budgeters/adakv.cuh"
#include "kvevict/backends/cuda/budgeters/headwise_learned.cuh"
#include "kvevict/backends/cuda/budgeters/per_head.cuh"
#include "kvevict/backends/cuda/selectors/topk.cuh"
