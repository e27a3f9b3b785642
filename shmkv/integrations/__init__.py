"""Integrations of shmkv with model libraries (imported on demand, never by ``shmkv``)."""
