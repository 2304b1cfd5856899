"""Ray cluster layer: driver, rank actors, coordinator, restarts, job submission. The only Ray importer."""
