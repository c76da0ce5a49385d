"""`verst serve`: the embedded engine behind SGLang's native HTTP API (`server`) and the OpenAI API
(`openai_protocol`, `openai_api`), LoRA routes (`lora_http`), and the same OpenAI frontend
in-process, without HTTP (`inprocess_openai`).

    python -m verst.rollout.engines.serve --model PATH --port 30000
"""
