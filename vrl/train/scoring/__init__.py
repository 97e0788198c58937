"""A trained model scored: sequences packed into rows and scored (scorer), lm-evaluation-harness's
model `vrl` over it (lm_eval_model) and its tasks found and loaded (lm_eval_tasks). Used by the tools,
the experiments and the loop's downstream hook; imports vrl.core, data, model and vrl.train.trained."""
