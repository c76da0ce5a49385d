"""The policy and one optimizer step: model loading (`model`), FSDP (`fsdp`), LoRA (`lora`),
batch building (`batch`), sequence layouts (`layout`), log-probs (`logprobs`, `logit_head`),
the train step (`side.TrainSide`) and supervised warm starts (`sft`). Imports neither `sync` nor `run`."""
