"""Evaluations of a model: the trainer's validation loss and the long-context evaluations of a
trained run.

Where each part lives (a new evaluation is a module beside ``retrieval`` and
``loss_by_position``: it asks :mod:`.tasks` for its inputs, :mod:`.scoring` for the model's
per-token scores, and :mod:`.report` for its tables and plots; :mod:`.long_context` runs it):

* :mod:`.validation`: :class:`~.validation.Evaluator`, the validation loss during training;
* :mod:`.model`: a run's model loaded for evaluation (assembled by :mod:`..build`, as the trainer
  assembles it), the checks of the evaluated lengths;
* :mod:`.scoring`: per-token log-likelihood and greedy token of whole sequences, through the
  trainer's pipeline driver (:func:`~..step.run_schedule`);
* :mod:`.tasks`: held-out documents and the retrieval prompts (passkey, needle, kv);
* :mod:`.retrieval`, :mod:`.loss_by_position`, :mod:`.attention_probe`: the evaluations;
* :mod:`.report`: markdown tables, PNG plots, files;
* :mod:`.long_context`: the command ``megatron-s2-eval-long-context``;
* :mod:`.retrieval_corpus`: retrieval training documents in the evaluation's own formats.

Nothing is imported here: each module is imported by its own name.
"""
