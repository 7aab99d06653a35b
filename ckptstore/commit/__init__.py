"""Committing an engine's state as a step: plan the layers, store blobs, record the step.

``step.commit_step`` runs one commit across every rank: ``plan`` (may the step be committed,
which layers are saved, update ``stats``), ``blobs`` (hash, encode, put), ``record`` (the
commit point), over ``ranks`` (collectives); ``background`` runs commits behind training.
"""
