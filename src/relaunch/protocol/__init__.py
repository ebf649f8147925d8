"""The contracts between relaunch's processes, each defined once: the wire messages
(`messages`, encoded by `codec`, carried by `wire`), the training SDK's datagrams
(`datagrams`), the launch plan and the membership (`plans`), the environment a job's processes
get (`environment`), the state-directory layout (`layout`). Imported by the controller, the
launcher, the node agent and the training SDK; standard library only.

Import from the modules: this package imports none of them, so that a training process pays
only for what the SDK uses (it starts on the path of every recovery)."""
