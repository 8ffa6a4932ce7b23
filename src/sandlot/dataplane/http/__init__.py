"""The dataplane over HTTP: the route table (:mod:`.app`), its endpoints (:mod:`.routes`,
:mod:`.transfer`, :mod:`.langsmith`, :mod:`.websockets`), their plumbing (:mod:`.web`),
the OpenAPI document (:mod:`.openapi`), metrics (:mod:`.metrics`) and the host that
serves every sandbox (:mod:`.host`)."""
