"""Models the press examples and tests run on.

``kvevict.models.llama2c``: the stories260K Llama (llama2.c checkpoint format, GQA, RoPE) as PyTorch
modules, with the KV cache and the hook protocol of ``kvevict.press``; ``kvevict.models.tokenizer``:
its llama2.c tokenizer. The checkpoint is not part of the package: ``load_llama2c()`` reads
``$KVEVICT_MODEL_DIR/stories260K.bin`` (in a checkout, ../shared/models/stories260K by default).
"""
