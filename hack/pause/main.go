// pause: the one binary of the local cluster's images for real kubelet nodes (see
// tools/gemini_local/kubelet/). With no arguments it is the CRI sandbox ("pause") process; with
// arguments it prints them as one line and then waits the same way. Either way it exits 0 on
// SIGTERM or SIGINT (as PID 1 of a PID namespace, a signal without a handler is ignored).
package main

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	if len(os.Args) > 1 {
		fmt.Println(strings.Join(os.Args[1:], " "))
	}
	<-sigs
}
