"""Rollout engines beside the grouped decoder (``app.rollout``). ``vllm``: ``rollout.engine=vllm`` and
``eval.engine=vllm``, a vLLM engine colocated in each process, fed exactly the trainer's prompts and media
(``vllm_request``) and given the policy's weights before every rollout (``VLLMEngine.push_weights``)."""
