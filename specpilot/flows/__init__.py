"""Prefect flows (the only code that imports prefect): `tune` and `nightly`; deployments live in prefect.yaml."""
