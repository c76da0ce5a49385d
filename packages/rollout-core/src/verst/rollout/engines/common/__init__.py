"""What every engine and client shares: errors and request ids, the SGLang native wire types,
HTTP with retries, the weight-update group, CUDA IPC, LoRA adapter views. Imports no sibling."""
