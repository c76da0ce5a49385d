"""The vLLM engine: a client of vLLM's HTTP API (`client`), its wire (`wire`), server checks
(`checks`), LoRA (`lora`), NCCL weight transfer (`refit`, GPU only), a launcher (`launcher`) and
the two `[engine]` variants (`config`: type = "vllm" and "vllm_launch")."""
