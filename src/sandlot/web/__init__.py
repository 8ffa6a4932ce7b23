"""The browser workspace's server: boring-ui's routes over a sandbox or a local folder, its
sessions, and the one gateway to upstreams."""
