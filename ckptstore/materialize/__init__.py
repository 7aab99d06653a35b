"""Reading steps back out: ``directory`` (a DeepSpeed checkpoint directory, swapped into place),
``reader`` (fetch each blob once, verify, assemble), ``compose`` (specs that mix steps)."""
