"""The run engine: what every trainer needs around its method, on ``accelerate``.

Floors, each importing only the ones below it (``trl_flow.storage`` is the ground floor under all of them):

1. ``distributed``: the accelerator, collectives (``agree``, gathers of sharded tensors), process checks;
2. ``checkpoints`` (saving, discovery, rotation, resume), ``export`` (the final model), ``guards`` (launch and
   batch checks, warnings), ``tracking`` (trackers), ``prompt_encoding``, ``stored_embeds`` (precomputed prompt
   embeddings), ``interrupts`` (signals), ``compute_options`` (attention backend, regional compile), ``throughput``
   (TFLOPS and MFU);
3. ``output_dir`` (what a run may write or remove), ``model_setup`` (LoRA, optimizer, schedule, EMA), ``callbacks``
   (transformers' ``TrainerCallback`` events and ``TrainerControl`` flags);
4. ``train_loop``: the loop, the final save and push.

The trainers (``trl_flow.trainers``) sit above the engine; ``trl_flow.models`` and ``trl_flow.hub`` import nothing
from the trainers and, from the engine, only ``distributed``.
"""
