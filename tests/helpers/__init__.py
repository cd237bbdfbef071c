"""The test suite's helpers: build inputs, run a launch, run ranks, check that nothing is left.

    from helpers import CLUSTER, GPT, launch, local_cluster, plan_dict, tiny_model

``tests/`` has no ``__init__.py``, so pytest puts it on ``sys.path`` and ``helpers`` imports as a
top-level package (as ``_spawn`` does); a spawned rank inherits that path.

Inputs (:mod:`helpers.specs`): plain dicts equal to hand-written files, with keyword overrides.

- ``local_cluster(devices=2, vendors=("emu-a", "emu-b"), slowdown=2.0, groups=("fast", "slow"))``:
  the emulated mixed cluster on this machine; ``devices=(4, 2)`` gives a count per group, ``(1, 0)``
  leaves ``slow`` out. ``CLUSTER`` is ``local_cluster()``.
- ``cluster_dict(group_dict(...), ..., name=, devices=, network=)``: any other cluster, e.g. catalog
  GPUs for the predictor: ``group_dict("a100", "A100-SXM4-80GB", 2, 8, intra_node=link_dict("300
  GB/s", "5 us"))``, ``network_dict(inter_node=link_dict("100 GB/s"))``, and
  ``emulated_device("emu-b", slowdown=2.0)`` for a CPU device type of its own vendor.
- ``tiny_model("gpt" | "llama", **over)``: ``GPT`` and ``LLAMA``, 4 layers of width 64, fp32.
- ``plan_dict(pipelines, gbs=8, mbs=2, **fields)``, or one pipeline:
  ``plan_dict(stages=[stage_dict("fast", 0, 2), stage_dict("slow", 2, 4)], micro_batches=4)``.

Launches (:mod:`helpers.launching`): ``launch(tmp_path, model, plan, *flags, cluster=CLUSTER)``
writes the three files, runs ``hetero launch`` for ``STEPS`` steps in a session of its own (a
timeout ends its whole tree), fails the test if a process of the run outlives it, and returns
``(summary, process)``; ``launch_summary(...)`` returns the summary alone.
``assert_matches_reference(summary, model)`` compares the losses and gradient norms with one
process training the whole model (``reference(model)``), to ``RTOL``. ``live_run(tmp_path, plan)``:
the launcher's in-process elastic controller for the tiny model on local-cpu.yaml, workers not
started.

Processes (:mod:`helpers.processes`): ``with_communicator(fn, vendors=[...], args)`` runs
``fn(comm, *args)`` in one process per vendor tag, each with a ``hetero.comm.Communicator``;
``assert_no_leftover(run_dir, files=[...])`` fails when a process of the run is alive or an output
(or a half-written one beside it) exists; ``leftover(run_dir)`` lists those processes. They build on
``tests/_spawn.py`` (``spawn``, ``run_launcher``, ``end_launcher``), re-exported here.
``DictStore()`` stands in for the coordinator's store (``set``, ``get``, ``check``) in one process.

Checkpoints (:mod:`helpers.checkpoints`): ``random_state_checkpoint(path, model)`` writes a
plan-independent checkpoint at step 3 with every value random (the reshard tests' reference).

Hugging Face (:mod:`helpers.hf`, imported as ``from helpers.hf import ...``):
``assert_logits_equal_transformers(path, vocab)`` builds an HF checkpoint as one runtime stage and
asserts its logits equal transformers' (returns the spec); ``word_tokenizer(folder, words)`` saves
a word-level tokenizer folder (``<s>`` before each text, ``</s>`` its end token).

How to run the tiers and the rules for tests that start processes: docs/testing.md.
"""
from _spawn import SpawnError, end_launcher, free_port, run_launcher, spawn

from .checkpoints import random_state_checkpoint
from .launching import (LR, ROOT, RTOL, STEPS, assert_matches_reference, launch, launch_summary, live_run, reference,
                        write_yaml)
from .processes import DictStore, assert_no_leftover, leftover, with_communicator
from .specs import (CLUSTER, GPT, LLAMA, cluster_dict, emulated_device, group_dict, link_dict, local_cluster,
                    network_dict, plan_dict, stage_dict, tiny_model)

__all__ = ["SpawnError", "end_launcher", "free_port", "run_launcher", "spawn",
           "LR", "ROOT", "RTOL", "STEPS", "assert_matches_reference", "launch", "launch_summary", "live_run", "reference",
           "write_yaml", "DictStore", "assert_no_leftover", "leftover", "with_communicator", "random_state_checkpoint",
           "CLUSTER", "GPT", "LLAMA", "cluster_dict", "emulated_device", "group_dict", "link_dict", "local_cluster",
           "network_dict", "plan_dict", "stage_dict", "tiny_model"]
