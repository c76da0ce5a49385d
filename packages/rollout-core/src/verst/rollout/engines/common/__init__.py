"""What every engine and client shares: errors and request ids, the SGLang native wire types,
HTTP with retries (`http`), the weight-update group, CUDA IPC, LoRA config and adapter view
(`lora`). Imports no sibling."""
