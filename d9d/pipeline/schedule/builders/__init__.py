"""One module per schedule: each turns (pp size, microbatches) into per-rank compute orders."""
