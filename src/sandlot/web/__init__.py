"""The browser workspace's server: its routes, its sessions, and the one gateway to upstreams."""
