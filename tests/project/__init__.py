"""The project itself: the layout of agent/, the shape of its code, the docs, the scripts and the installer."""
