"""What a run stands on, stage-independent: loading models and processors (``models``), LoRA (``lora``),
processes and devices (``distributed``), the data/sequence-parallel context passed to every stage (``parallel``),
DeepSpeed ZeRO set-up and gathering (``zero``), checkpoints and resume (``checkpoint``), metrics, wandb and the
progress bar (``tracking``), plots of a run's metrics (``plots``, ``python -m app.runtime.plots``).

May import: ``app.common``, ``app.grouping`` (the sequence-parallel plan and the attention setting the context and
ZeRO helpers pass on).
Exports: none at package level (``python -m app.runtime.distributed`` and ``app.runtime.plots`` are entry points);
import the modules.
"""
