"""The agent end to end as it is deployed: real pretrained models, fuzzing and hostile inputs against a running agent,
the service under real systemd (nspawn) and on arm64 (qemu-user)."""
