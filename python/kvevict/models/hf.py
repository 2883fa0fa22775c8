"""stories260K as a Hugging Face transformers ``LlamaForCausalLM``: our own converter from the
llama2.c checkpoint (no weights from a hub).

``to_transformers(model)`` takes ``kvevict.models.llama2c.Llama`` (or a checkpoint path) and returns
a ``LlamaForCausalLM`` in eval mode with the same weights. The one layout change is RoPE's: llama2.c
rotates interleaved pairs (x[2i], x[2i+1]) of each head, transformers' Llama rotates halves
(x[i], x[i + head_dim/2]) (``rotate_half``), so the rows of ``q_proj`` and ``k_proj`` are permuted
inside each head, pair i to positions (i, i + head_dim/2). Attention logits, and so every score
kvevict computes from queries and keys (dot products, norms), are unchanged by that permutation;
the cached keys hold the same numbers in another feature order. Values, ``o_proj``, the MLP, the
norms and the tied classifier are copied as they are.

Checked by tests/python/test_hf.py: the logits equal ``llama2c.Llama``'s (fp32, max difference
about 2e-5 over 300 positions) and the model README's golden values (top-5 at position 0, greedy
continuation of BOS). Needs ``transformers`` (>= 4.48, with ``head_dim`` in LlamaConfig) and a torch
it supports; Debian's python3-torch 1.13 is too old for current transformers.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import llama2c

__all__ = ["to_transformers", "to_transformers_tokenizer", "rope_halves"]


def rope_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection [n_heads * head_dim, dim] from llama2.c's interleaved RoPE pairs to
    transformers' halves: in each head, row 2i goes to i and row 2i + 1 to i + head_dim / 2."""
    d1, d2 = w.shape
    if d1 % n_heads or (d1 // n_heads) % 2:
        raise ValueError(f"rope_halves: {d1} rows are not n_heads = {n_heads} heads of an even head_dim")
    return w.reshape(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def to_transformers(model: Union[llama2c.Llama, str, None] = None, dtype: Optional[torch.dtype] = None):
    """The llama2.c model ``model`` (a loaded ``Llama``, a checkpoint path, or None: the default
    stories260K, ``llama2c.load_llama2c()``) as a ``transformers.LlamaForCausalLM`` (eval mode,
    ``dtype`` or float32). Attention implementation "sdpa"; pass the model to ``kvevict.hf.Press``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = model if isinstance(model, llama2c.Llama) else llama2c.load_llama2c(model)
    c = m.cfg
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
                      num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                      max_position_embeddings=c.seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                      tie_word_embeddings=c.shared_classifier, attention_bias=False, mlp_bias=False, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    hf = LlamaForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": m.tok_emb, "model.norm.weight": m.rms_final}
    if m.wcls is not None:
        sd["lm_head.weight"] = m.wcls
    for l in range(c.n_layers):
        p = f"model.layers.{l}."
        sd[p + "self_attn.q_proj.weight"] = rope_halves(m.wq[l], c.n_heads)
        sd[p + "self_attn.k_proj.weight"] = rope_halves(m.wk[l], c.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = m.wv[l]
        sd[p + "self_attn.o_proj.weight"] = m.wo[l]
        sd[p + "mlp.gate_proj.weight"] = m.w1[l]
        sd[p + "mlp.down_proj.weight"] = m.w2[l]
        sd[p + "mlp.up_proj.weight"] = m.w3[l]
        sd[p + "input_layernorm.weight"] = m.rms_att[l]
        sd[p + "post_attention_layernorm.weight"] = m.rms_ffn[l]
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    allowed = {"lm_head.weight"} if c.shared_classifier else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"to_transformers: state dict mismatch: missing {missing}, unexpected {unexpected}")
    if c.shared_classifier:
        hf.tie_weights()
    # LKV's learned scorer reads key features in the order it was trained on (llama2.c's): kvevict.hf
    # puts converted keys back in that order for it (scores of dot products and norms do not care).
    hf.config.kvevict_llama2c_rope = True
    hf.eval().requires_grad_(False)
    return hf.to(dtype) if dtype is not None else hf


def to_transformers_tokenizer(path: Optional[str] = None):
    """stories260K's tokenizer (llama2.c's ``tok512.bin``; ``path`` or the default model folder) as a
    transformers ``PreTrainedTokenizer``, so that transformers' and kvpress's pipelines run on the
    converted model (``pipeline("kv-press-text-generation", model=to_transformers(),
    tokenizer=to_transformers_tokenizer())``).

    It encodes and decodes exactly as ``kvevict.models.tokenizer.Tokenizer`` (the llama2.c rules:
    a dummy space before the text, byte pieces ``<0xNN>`` for characters outside the vocabulary,
    merges by score; decoding drops the space after BOS). Ids 0, 1, 2 are ``<unk>``, ``<s>`` (BOS),
    ``</s>`` (EOS); ``add_special_tokens=True`` prepends BOS. No chat template: kvpress's pipeline
    then prepends ``bos_token`` to the context itself."""
    from transformers import PreTrainedTokenizer

    from .tokenizer import Tokenizer

    class Llama2cTokenizer(PreTrainedTokenizer):
        vocab_files_names: dict = {}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, tok_path=None, **kwargs):
            self._tok = Tokenizer(tok_path)
            names = []
            for i, p in enumerate(self._tok.pieces):
                names.append({0: "<unk>", 1: "<s>", 2: "</s>"}.get(i, p.decode("utf-8", errors="backslashreplace")))
            self._names = names
            self._ids = {}
            for i, n in enumerate(names):
                self._ids.setdefault(n, i)
            kwargs.setdefault("bos_token", "<s>")
            kwargs.setdefault("eos_token", "</s>")
            kwargs.setdefault("unk_token", "<unk>")
            kwargs.setdefault("model_max_length", 512)
            super().__init__(**kwargs)

        @property
        def vocab_size(self) -> int:
            return self._tok.vocab_size

        def get_vocab(self):
            return dict(self._ids)

        def _tokenize(self, text, **kwargs):
            return [self._names[i] for i in self._tok.encode(text, bos=False)]

        def _convert_token_to_id(self, token):
            return self._ids.get(token, 0)

        def _convert_id_to_token(self, index):
            return self._names[index]

        def convert_tokens_to_string(self, tokens):
            return self._tok.decode([self._ids.get(t, 0) for t in tokens], prev=1)

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            ids = [self.bos_token_id] + list(token_ids_0)
            return ids if token_ids_1 is None else ids + list(token_ids_1)

        def save_vocabulary(self, save_directory, filename_prefix=None):
            return ()

    return Llama2cTokenizer(path)
