"""Trained weights to the engines: `WeightSync` (`weight_sync`), its modes (`modes`), the
distributed group (`distributed`), LoRA adapters (`lora`), colocated memory (`colocate`)."""
