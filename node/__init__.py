"""The serving node: engine, model runner, models, processes and HTTP front."""
