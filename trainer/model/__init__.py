"""DFlash model side: frozen target capture, the drafter, the objective, export.

Modules import torch and transformers; import them directly (`trainer.model.target`, ...),
this package file stays empty so `import trainer.model` costs nothing.
"""
