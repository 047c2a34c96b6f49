"""The stores a trace lives in: every array (``schema``), row formats (``rowformat``), what a store
must be before it is read (``integrity``), creating and opening (``store``; the ``ds.kvscope``
accessor in ``dataset``), ``verify``, ``compact``, output paths checked before any work
(``paths``), fp16 conversions (``dtypes``) and synthetic stores for tests and benchmarks
(``synthetic``)."""
