// pause: the one binary of the local cluster's images for real kubelet nodes (see
// tools/gemini_local/kubelet/). With no arguments it is the CRI sandbox ("pause") process; with
// arguments it prints them as one line and then waits the same way. Either way it exits 0 on
// SIGTERM or SIGINT (as PID 1 of a PID namespace, a signal without a handler is ignored).
//
// Two modes check pod networking between nodes:
//   --echo PORT WORDS...  also answers every TCP connection on PORT with WORDS and a newline;
//   --dial ADDR           connects to ADDR (host:port) every half second and prints
//                         "reply: <line>" or "error: <why>" for each try.
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func echo(port string, words string) {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				continue
			}
			fmt.Fprintln(conn, words)
			conn.Close()
		}
	}()
}

func dial(addr string) {
	go func() {
		for {
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err == nil {
				conn.SetDeadline(time.Now().Add(2 * time.Second))
				line, rerr := bufio.NewReader(conn).ReadString('\n')
				conn.Close()
				if rerr == nil {
					fmt.Println("reply:", strings.TrimSpace(line))
				} else {
					err = rerr
				}
			}
			if err != nil {
				fmt.Println("error:", err)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}()
}

func main() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	args := os.Args[1:]
	switch {
	case len(args) >= 2 && args[0] == "--echo":
		echo(args[1], strings.Join(args[2:], " "))
	case len(args) == 2 && args[0] == "--dial":
		dial(args[1])
	}
	if len(args) > 0 {
		fmt.Println(strings.Join(args, " "))
	}
	<-sigs
}
