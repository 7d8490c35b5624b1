// Command cluster is the Kubernetes control plane of PagedLLM's tests, built from Kubernetes' own
// Go modules: one binary, one upstream component per subcommand (or per name it is called by,
// so that a symlink named kubectl is kubectl). Each component runs as a process of its own, as a
// real control plane runs them, so that each can be stopped and restarted alone.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cluster etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubectl [flags]")
	os.Exit(2)
}

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if name == "cluster" || name == "pagedllm-cluster" {
		if len(args) == 0 {
			usage()
		}
		name, args = args[0], args[1:]
	}
	// Each upstream command reads its flags from os.Args, as its own main does.
	os.Args = append([]string{name}, args...)
	switch name {
	case "etcd":
		etcdmain.Main(os.Args)
	case "kubectl":
		// As cmd/kubectl's main: errors are printed by CheckErr with kubectl's exit codes.
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
	default:
		newCommand, ok := components[name]
		if !ok {
			usage()
		}
		os.Exit(cli.Run(newCommand()))
	}
}
