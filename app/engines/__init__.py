"""Rollout engines beside the grouped decoder (``app.rollout``): what each needs to receive exactly the trainer's
inputs. ``vllm``: prompts for vLLM (``vllm_prompts``); the colocated engine itself (``rollout.engine=vllm``) is not
built yet."""
