"""Images in prompts and observations (docs/vlm.md).

- `images`: image references (path + SHA-256), decoding, the content-addressed `ImageStore`;
- `families`: the supported VLM families (LLaVA, Idefics3/SmolVLM) in one table;
- `processor`: `MultimodalProcessor`, the one place image tokens are expanded and image
  features enter the embeddings (engine and trainer both use it);
- `toy`: tiny VLM checkpoints built from config.

Needs the `local` extra (torch, transformers, Pillow); imported only when images are used.
"""
