"""Models, their layers, and the code that builds a model and fills its weights.

`model_loader.get_model` is the entry point; `models.get_model_class` the registry.
"""
