"""Built-in providers, selectable by name in the job config (see `d9d.engine.registry`)."""
