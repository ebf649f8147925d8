// etcd, built from its published module: Debian's etcd (3.4) is older than Kubernetes 1.37 needs.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
