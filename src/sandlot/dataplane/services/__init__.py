"""What the dataplane does for one sandbox, with no HTTP in it.

- the sandbox and its services: :mod:`.sandbox` (``SandboxEntry``, ``SandboxServices``)
- commands and shells: :mod:`.execs`, :mod:`.shells`, with :mod:`.streams`,
  :mod:`.spool` and :mod:`.procio` for their output
- files: :mod:`.paths` (confinement), :mod:`.fsids` (acting as the sandbox user),
  :mod:`.fsops`, :mod:`.archives`, :mod:`.tarstream`, :mod:`.native` (the C library)
- search: :mod:`.globbing`, :mod:`.globworker`, :mod:`.grep`, :mod:`.grepcache`
- events: :mod:`.events`, :mod:`.watch`, :mod:`.diskfull`
- who may call: :mod:`.auth`, :mod:`.socketlimits`
"""
