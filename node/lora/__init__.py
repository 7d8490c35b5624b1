"""LoRA adapters: many fine-tunes of one base model served together.

``request`` is what a request names (``pagedllm.core.lora_request`` under vLLM's path: the
scheduler, below this package, keys blocks by it); ``peft_files``
reads and checks a PEFT adapter's files without torch; ``adapter`` loads its weights;
``layers`` adds the active adapters' products to the base model's linear layers for a whole
batch at once; ``manager`` (a worker's) holds the loaded adapters and prepares each step.
"""
