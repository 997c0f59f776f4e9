"""Trainer callbacks: record a framework's training loop without writing one.

- `gradstore.integrations.huggingface.GradstoreCallback`: a `transformers.TrainerCallback`
  (`pip install 'gradstore[huggingface]'`);
- `gradstore.integrations.lightning.GradstoreCallback`: a `lightning.pytorch.Callback`
  (`pip install 'gradstore[lightning]'`).

Each module imports its framework when it is imported itself; `import gradstore` imports neither.
"""
